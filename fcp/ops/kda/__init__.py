"""Kimi Delta Attention (KDA) and Gated DeltaNet (GDN) over packed documents, exact under
contiguous CP.

GDN is KDA with one gate per head instead of one per key dimension: :func:`kda` takes either
(``g [B, L, HV]`` or ``[B, L, HV, K]``); the scalar gate is never broadcast to ``[.., K]`` on
the default backend.

* :mod:`.reference` - the definition (per-token recurrence; tests only);
* :mod:`.chunked` - the exact static-shape PyTorch path (``backend="chunked"``, the default);
* :mod:`.fla` - FLA's Triton kernels as custom ops (``backend="fla"`` / ``"fla_varlen"``, CUDA).

:func:`kda` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_power_of_two, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kda.chunked import kda_chunked
from fcp.ops.kit.common import (
    autocast_off,
    choose_backend,
    default_scale,
    finite_or_zero,
    zero_nonfinite_grad,
)
from fcp.pytree import has_data

__all__ = ["BACKENDS", "check_kda_inputs", "kda"]

#: ``"chunked"``: exact PyTorch, every device. ``"fla"``: FLA's dense kernel with gate resets
#: (CUDA, compile and CUDA-graph safe, not bitwise document-independent). ``"fla_varlen"``:
#: FLA's varlen / CP path (CUDA, host metadata per batch).
BACKENDS = ("chunked", "fla", "fla_varlen")


def check_kda_inputs(q, k, v, g, beta, local_len: int | None, batch: int | None) -> None:
    """Types and shapes of :func:`kda`'s tensors (the :mod:`fcp.checks` rule, naming the tensor),
    and, in eager mode on tensors with data, that the log decay ``g`` is ``<= 0``.

    The ``g`` check reads values (one host synchronisation), so it is skipped while compiling and
    for tensors without data (:func:`fcp.pytree.has_data`): a compiled region never
    synchronises. Non-finite entries are left to the isolation rule (:mod:`fcp.ops.kit.common`).

    >>> x, beta = torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1)
    >>> check_kda_inputs(x, x, x, torch.tensor([[[0.0], [0.5]]]), beta, None, None)
    Traceback (most recent call last):
    ...
    ValueError: kda: g is a log decay and must be <= 0, got g[0, 1, 0] = 0.5 ...
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(t, name, fn="kda", kind="float")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"kda: q and k must be [batch, seq, heads, K] with equal shapes, got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t):
        raise ValueError(f"kda: v must be [batch={b}, seq={t}, value_heads, V], got {tuple(v.shape)}")
    hv = v.shape[2]
    if h == 0 or hv % h:
        raise ValueError(f"kda: value_heads={hv} must be a multiple of heads={h} (GVA)")
    if g.shape not in ((b, t, hv), (b, t, hv, dk)):
        raise ValueError(
            f"kda: g must be [{b}, {t}, {hv}] (one gate per head, GDN) or [{b}, {t}, {hv}, {dk}] "
            f"(per key dimension, KDA), got {tuple(g.shape)}"
        )
    if beta.shape != (b, t, hv):
        raise ValueError(f"kda: beta must be [{b}, {t}, {hv}], got {tuple(beta.shape)}")
    if has_data(g):
        growing = (g > 0) & (g != float("inf"))  # a positive finite log decay: the state grows
        if bool(growing.any()):
            hit = tuple(growing.nonzero()[0].tolist())
            raise ValueError(
                f"kda: g is a log decay and must be <= 0, got g[{', '.join(map(str, hit))}] = "
                f"{g[hit].item()} (a positive g makes the state grow and the output overflow to "
                "NaN; e.g. pass -softplus(x) or log(sigmoid(x)))"
            )
    if local_len is not None and t != local_len:
        raise ValueError(f"kda: seq={t} != ctx.local_seq_len={local_len}")
    if batch is not None and b != batch:
        raise ValueError(f"kda: batch={b} != ctx.batch_size {batch}")


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        ctx: PackedContext, scale: float | None = None, chunk_size: int = 64, *,
        backend: str = "auto") -> torch.Tensor:
    """Kimi Delta Attention (or Gated DeltaNet) on this rank's shard of a packed batch.

    Args:
        q, k: ``[batch, local_seq, heads, K]`` (k is usually L2-normalised).
        v: ``[batch, local_seq, value_heads, V]``; ``value_heads`` is a multiple of ``heads``
            (GVA: value head ``j`` uses q/k head ``j // (value_heads // heads)``, i.e. q and k
            are ``repeat_interleave``-d, as in transformers' Qwen3-Next and NeMo's Gated
            DeltaNet layers; pass q/k un-repeated).
        g: log decay (natural log, <= 0, checked in eager mode: ``ValueError`` naming the first
            positive entry; no overflow whatever the decay: exponents are always <= 0; tested
            with -8, 0 and -40 per token), either
            ``[batch, local_seq, value_heads, K]``, one per key dimension (KDA: ``S <-
            diag(exp(g_t)) S``), or ``[batch, local_seq, value_heads]``, one per head (Gated
            DeltaNet: ``S <- exp(g_t) S``). A per-head gate is the same recurrence as that gate
            broadcast over K, computed without the ``[.., K]`` gate on ``"chunked"`` (the FLA
            backends broadcast it to FLA's KDA kernels).
        beta: ``[batch, local_seq, value_heads]`` delta-rule step sizes.
        ctx: this rank's :class:`~fcp.context.PackedContext`; ``local_seq`` must be
            ``ctx.local_seq_len``. The state restarts at every run start of the global map
            (documents and the pad tail).
        scale: query scale, default ``K ** -0.5``.
        chunk_size: tokens per chunk, a power of two (32 or 64 for the FLA backends).
        backend: ``"auto"`` (= ``"chunked"`` on every device), ``"chunked"``, ``"fla"`` or
            ``"fla_varlen"`` (CUDA tensors only); see :data:`BACKENDS` and each backend's
            docstring for its guarantees.

    Returns:
        ``[batch, local_seq, value_heads, V]`` in ``v``'s dtype. State and accumulation are fp32
        (fp64 for fp64 inputs on ``"chunked"``).

    Every backend keeps non-finite values inside their document (:mod:`fcp.ops.kit.common`): a NaN
    or inf in one document's inputs or output gradient leaves every other document's outputs
    and input gradients unchanged. The default backend is exact to fp32 rounding, bitwise
    document-independent, deterministic, sync-free and recompile-free across packings. Under CP,
    one :func:`~fcp.comm.state_chain` all-gather of ``[batch, value_heads, K, K + V]`` per call.

    Example (K = V = 1, q = k = 1, g = 0, beta = 0.5, scale 1: ``S <- S + 0.5 (v - S)``, so each
    output is the running average restarted at every document; documents of lengths 3 and 2,
    then one pad token)::

        >>> doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0]])
        >>> ones = torch.ones(1, 6, 1, 1)
        >>> v = torch.tensor([2.0, 2, 2, 4, 4, 8]).view(1, 6, 1, 1)
        >>> o = kda(ones, ones, v, torch.zeros(1, 6, 1, 1), torch.full((1, 6, 1), 0.5),
        ...         PackedContext(doc_ids), scale=1.0)
        >>> o.flatten().tolist()
        [1.0, 1.5, 1.75, 2.0, 3.0, 4.0]
    """
    check_context(ctx, fn="kda")
    check_kda_inputs(q, k, v, g, beta, ctx.local_seq_len, ctx.batch_size)
    chunk_size = check_power_of_two(chunk_size, "chunk_size", fn="kda")
    backend = choose_backend("kda", backend, BACKENDS, "chunked")
    scale = default_scale(q.shape[-1], scale)
    q, k, v, g, beta = (finite_or_zero(t) for t in (q, k, v, g, beta))
    if backend != "chunked" and g.dim() == 3:
        # FLA's KDA kernels take per-key-dimension gates (fcp wraps no GDN kernel): broadcast
        g = g[..., None].expand(*g.shape, q.shape[-1])
    if backend == "chunked":
        run = kda_chunked
    else:
        from fcp.ops.kda import fla  # imported on use: a CUDA-only path

        if not q.is_cuda:
            raise ValueError(f"kda: backend={backend!r} needs CUDA tensors, got {q.device}")
        if chunk_size not in fla.FLA_CHUNK_SIZES or q.shape[-1] > 256:
            raise ValueError(
                f"kda: backend={backend!r} needs chunk_size in {fla.FLA_CHUNK_SIZES} and "
                f"K <= 256, got chunk_size={chunk_size}, K={q.shape[-1]}"
            )
        run = fla.kda_fla_static if backend == "fla" else fla.kda_fla_varlen
    with autocast_off(q.device):
        out = run(q, k, v, g, beta, ctx, scale, chunk_size)
    return zero_nonfinite_grad(out)
