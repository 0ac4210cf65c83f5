"""What the attention operators share: argument checks, backend choice, CP plumbing."""

from __future__ import annotations

import torch

from fcp.comm import all_gather_backward_anchor
from fcp.context import PackedContext
from fcp.ops.attention import flex
from fcp.ops.common import choose_backend

__all__ = [
    "BACKENDS",
    "attention_backend",
    "check_qkv",
    "positive_int",
    "with_anchors",
    "query_positions",
]

#: ``"dense"``: masked fp32 softmax, every device (O(local x keys) scores). ``"flex"``:
#: FlexAttention with the same masks (the default on CUDA; no backward on CPU).
BACKENDS = ("dense", "flex")


def attention_backend(name: str, backend: str, q: torch.Tensor) -> str:
    """Resolve ``backend`` for operator ``name``: ``"auto"`` is ``"flex"`` for CUDA tensors
    (when FlexAttention is available) and ``"dense"`` elsewhere. A static fact: Dynamo folds it."""
    auto = "flex" if q.is_cuda and flex.available() else "dense"
    return choose_backend(name, backend, BACKENDS, auto)


def check_qkv(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PackedContext):
    """Validate ``q [b, L, H, D]``, ``k [b, L, Hkv, D]``, ``v [b, L, Hkv, Dv]`` against ``ctx``."""
    if not isinstance(ctx, PackedContext):
        raise TypeError(f"{name}: context must be a PackedContext, got {type(ctx).__name__}")
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {what} must be [batch, local_seq, heads, dim], got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {what} must be floating point, got {t.dtype}")
    b, n, h, d = q.shape
    if (b, n) != (ctx.batch_size, ctx.local_seq_len):
        raise ValueError(
            f"{name}: q has [batch, local_seq] = {[b, n]} but the context expects "
            f"{[ctx.batch_size, ctx.local_seq_len]}"
        )
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must share [batch, local_seq, "
            f"kv_heads] with each other and [batch, local_seq] with q {tuple(q.shape)}"
        )
    if k.shape[3] != d:
        raise ValueError(f"{name}: k head dim {k.shape[3]} != q head dim {d}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"{name}: heads={h} must be a multiple of kv_heads={hkv} (GQA)")


def positive_int(name: str, what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {what} must be a positive int, got {value!r}")
    return value


def query_positions(ctx: PackedContext, device) -> torch.Tensor:
    """int64 ``[local_seq]``: global positions of this rank's queries."""
    return torch.arange(ctx.seq_start, ctx.seq_end, device=device)


def with_anchors(out: torch.Tensor, ctx: PackedContext, *received: torch.Tensor) -> torch.Tensor:
    """``out`` plus zero-valued backward anchors on tensors received from other ranks.

    The outputs already depend on the received tensors through the masked products, but an
    anchor makes joining their backward collectives independent of how the loss uses ``out``.
    No-op without CP.
    """
    if not ctx.cp_enabled:
        return out
    for t in received:
        out = out + all_gather_backward_anchor(t).to(out.dtype)
    return out
