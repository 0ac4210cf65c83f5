"""What the softmax-attention operators share: the q/k/v rule, the backend choice, query
positions and the backward anchors on tensors received from other ranks.

Used by :mod:`fcp.ops.doc_causal`, :mod:`fcp.ops.compressed` and :mod:`fcp.ops.index_attention`
(each operator folder imports only this kit, never another operator).
"""

from __future__ import annotations

import torch

from fcp.checks import check_float, check_positive_int, check_tensor
from fcp.comm import all_gather_backward_anchor
from fcp.context import PackedContext
from fcp.ops.kit import flex
from fcp.ops.kit.common import choose_backend

__all__ = [
    "SOFTMAX_BACKENDS",
    "attention_backend",
    "check_qkv",
    "check_selection",
    "check_sinks_softcap",
    "with_anchors",
    "query_positions",
]

#: ``"dense"``: banded masked fp32 softmax, every device (O(local x band) scores). ``"flex"``:
#: FlexAttention with the same masks (the default on CUDA; no backward on CPU).
SOFTMAX_BACKENDS = ("dense", "flex")


def attention_backend(name: str, backend: str, q: torch.Tensor) -> str:
    """Resolve ``backend`` for operator ``name``: ``"auto"`` is ``"flex"`` for CUDA tensors
    (when FlexAttention is available) and ``"dense"`` elsewhere. A static fact: Dynamo folds it."""
    auto = "flex" if q.is_cuda and flex.available() else "dense"
    return choose_backend(name, backend, SOFTMAX_BACKENDS, auto)


def check_qkv(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PackedContext,
              key_len: int | None = None) -> None:
    """Validate ``q [b, L, H, D]``, ``k [b, S, Hkv, D]``, ``v [b, S, Hkv, Dv]`` against ``ctx``.

    ``S`` is ``key_len`` (default: the local length ``L``). Floating point, ``H`` a multiple of
    ``Hkv`` (GQA). The rule of :mod:`fcp.checks`: wrong types ``ArgumentTypeError``, wrong shapes
    ``ValueError``, each naming ``name`` and the tensor. ``ctx`` is already checked by the
    calling dispatcher (its one :func:`~fcp.context.check_context`).
    """
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(t, what, fn=name, kind="float", dim=4, layout="[batch, seq, heads, dim]")
    b, n, h, d = q.shape
    if (b, n) != (ctx.batch_size, ctx.local_seq_len):
        raise ValueError(
            f"{name}: q has [batch, local_seq] = {[b, n]} but the context expects "
            f"{[ctx.batch_size, ctx.local_seq_len]}"
        )
    keys = n if key_len is None else key_len
    if tuple(k.shape[:2]) != (b, keys) or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must be [{b}, {keys}, kv_heads, "
            f"D | Dv] with equal kv_heads (q is {tuple(q.shape)})"
        )
    if k.shape[3] != d:
        raise ValueError(f"{name}: k head dim {k.shape[3]} != q head dim {d}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"{name}: heads={h} must be a multiple of kv_heads={hkv} (GQA)")


def check_sinks_softcap(name: str, sinks, softcap, q: torch.Tensor):
    """``(sinks [B, L, H] | None, softcap float | None)`` checked against ``q [B, L, H, D]``.

    ``sinks``: a floating tensor ``[H]`` (one learned logit per head, gpt-oss) or ``[B, L, H]``
    (one per query, e.g. projected from the hidden states), expanded to ``[B, L, H]``;
    ``softcap``: ``None`` or a float ``> 0``.
    """
    if sinks is not None:
        b, n, h = q.shape[:3]
        check_tensor(sinks, "sinks", fn=name, kind="float", dim=(1, 3),
                     layout="[heads] or [batch, local_seq, heads]")  # fmt: skip
        if tuple(sinks.shape) not in ((h,), (b, n, h)):
            raise ValueError(f"{name}: sinks {tuple(sinks.shape)} must be [heads] = [{h}] or "
                             f"[batch, local_seq, heads] = [{b}, {n}, {h}]")  # fmt: skip
        sinks = sinks.expand(b, n, h)
    if softcap is not None:
        softcap = check_float(softcap, "softcap", fn=name, positive=True)
    return sinks, softcap


def query_positions(ctx: PackedContext, device) -> torch.Tensor:
    """int64 ``[local_seq]``: global positions of this rank's queries."""
    return torch.arange(ctx.seq_start, ctx.seq_end, device=device)


def with_anchors(out: torch.Tensor, ctx: PackedContext, *received: torch.Tensor) -> torch.Tensor:
    """``out`` plus zero-valued backward anchors on tensors received from other ranks.

    The outputs already depend on the received tensors through the masked products, but an
    anchor makes joining their backward collectives independent of how the loss uses ``out``
    (a rank holding only padding, or only queries that select nothing). No-op without CP.
    """
    if not ctx.cp_enabled:
        return out
    for t in received:
        out = out + all_gather_backward_anchor(t).to(out.dtype)
    return out


def check_selection(indices: torch.Tensor, query_chunk: int | None, batch: int, local: int, *,
                    fn: str) -> int | None:  # fmt: skip
    """The selection arguments of the attentions over selected tokens (``index_attention``,
    ``latent_attention``): ``indices`` int ``[batch, local, width >= 1]`` global token ids (-1:
    none) and ``query_chunk`` (``None`` or a positive int, returned)."""
    check_tensor(indices, "indices", fn=fn, kind="int", shape=(batch, local, None),
                 layout="[batch, local_seq, width]")  # fmt: skip
    if indices.shape[2] < 1:
        raise ValueError(f"{fn}: indices {tuple(indices.shape)} must have width >= 1")
    return None if query_chunk is None else check_positive_int(query_chunk, "query_chunk", fn=fn)
