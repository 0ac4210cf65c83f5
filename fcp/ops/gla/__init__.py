"""Gated linear attention over packed documents, exact under contiguous CP: a scalar decay per
head (Mamba2's SSD) or a decay per key dimension (GLA proper, Mamba1's selective scan).

* :mod:`.reference` - the definition (per-token recurrence; tests only);
* :mod:`.chunked` - the exact static-shape PyTorch path (``backend="chunked"``, the default);
* :mod:`.keyed` - its form for a decay per key dimension (``a [B, L, H, K]``);
* :mod:`.fla` - FLA's scalar-gate chunk kernels as custom ops (``backend="fla"``, CUDA);
* :mod:`.fla_keyed` - FLA's per-key-gate ``chunk_gla`` kernels, likewise (``a [B, L, H, K]``).

:func:`gla` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_power_of_two, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.gla.chunked import gla_chunked
from fcp.ops.gla.keyed import gla_keyed_chunked
from fcp.ops.kit.common import (
    autocast_off,
    choose_backend,
    default_scale,
    finite_or_zero,
    zero_nonfinite_grad,
)

__all__ = ["BACKENDS", "check_gla_inputs", "gla"]

#: ``"chunked"``: exact PyTorch, every device. ``"fla"``: FLA's dense ``simple_gla`` kernels (a
#: decay per head) or ``chunk_gla`` kernels (per key) with decay resets at document starts (CUDA,
#: compile and CUDA-graph safe, not bitwise document-independent).
BACKENDS = ("chunked", "fla")


def check_gla_inputs(q, k, v, a, local_len: int | None, batch: int | None) -> None:
    """Types and shapes of :func:`gla`'s tensors (the :mod:`fcp.checks` rule, naming the tensor)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a)):
        check_tensor(t, name, fn="gla", kind="float")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"gla: q and k must be [batch, seq, groups, K] with equal shapes, got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    b, t, groups = q.shape[:3]
    if v.dim() != 4 or v.shape[:2] != (b, t):
        raise ValueError(f"gla: v must be [batch={b}, seq={t}, heads, V], got {tuple(v.shape)}")
    heads = v.shape[2]
    if groups == 0 or heads % groups:
        raise ValueError(f"gla: heads={heads} must be a multiple of groups={groups} (GQA)")
    if a.shape not in ((b, t, heads), (b, t, heads, q.shape[3])):
        raise ValueError(f"gla: a must be [{b}, {t}, {heads}] (one decay per head) or "
                         f"[{b}, {t}, {heads}, {q.shape[3]}] (one per key dimension), got "
                         f"{tuple(a.shape)}")  # fmt: skip
    if local_len is not None and t != local_len:
        raise ValueError(f"gla: seq={t} != ctx.local_seq_len={local_len}")
    if batch is not None and b != batch:
        raise ValueError(f"gla: batch={b} != ctx.batch_size {batch}")


def gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
        ctx: PackedContext, scale: float | None = None, chunk_size: int = 64, *,
        backend: str = "auto") -> torch.Tensor:
    """Gated linear attention with one decay per head, or per key dimension, on this rank's
    shard of a packed batch.

    Per head ``h``, a ``[K, V]`` state restarted at zero at every document start::

        S_t = exp(a_t) S_{t-1} + k_t v_t^T,      o_t = scale * S_t^T q_t

    (``a_t`` a scalar per head, or ``diag(exp(a_t))`` with ``a_t`` a vector over K.)

    Args:
        q, k: ``[batch, local_seq, groups, K]``; head ``h`` reads group ``h // (heads //
            groups)`` (GQA, Mamba2's ``n_groups`` for C and B; pass them un-repeated).
        v: ``[batch, local_seq, heads, V]``; ``heads`` a multiple of ``groups``.
        a: ``[batch, local_seq, heads]`` or ``[batch, local_seq, heads, K]`` (a decay per key
            dimension), natural-log decay applied before each token's update,
            expected ``<= 0`` (no overflow whatever the decay: every exponent formed is a sum of
            ``a``'s, so ``<= 0``; tested with 0, -8 and -40 per token). A positive ``a`` is
            computed as written and may overflow.
        ctx: this rank's :class:`~fcp.context.PackedContext`; ``local_seq`` must be
            ``ctx.local_seq_len``. The state restarts at every run start of the global map
            (documents and the pad tail).
        scale: query scale, default ``K ** -0.5`` (Mamba2: pass ``1.0``).
        chunk_size: tokens per chunk, a power of two (64 for ``"fla"``).
        backend: ``"auto"`` (= ``"chunked"`` on every device), ``"chunked"`` or ``"fla"`` (CUDA
            tensors only); see :data:`BACKENDS` and each backend's docstring.

    Returns:
        ``[batch, local_seq, heads, V]`` in ``v``'s dtype. State and accumulation are fp32 (fp64
        for fp64 inputs on ``"chunked"``; the CP state chain is fp32).

    Every backend keeps non-finite values inside their document (:mod:`fcp.ops.kit.common`). The
    default backend is exact to fp32 rounding, bitwise document-independent, deterministic,
    sync-free and recompile-free across packings. Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of fp32 ``[batch, heads, K, K + V]`` per call.

    Mamba2's SSD (transformers' ``Mamba2Mixer`` / ``mamba2_chunk_scan``, mamba_ssm's
    ``mamba_chunk_scan_combined``) maps onto it with everything model-specific outside::

        dt = softplus(dt_raw + dt_bias).clamp(*time_step_limit)      # [B, L, H]
        A = -exp(A_log)                                                # [H]
        y = gla(C, B, dt[..., None] * x, dt * A, ctx, scale=1.0)      # C, B [B, L, G, N]
        y = y + D[:, None] * x                                         # the D skip
        # then the gated RMSNorm with z and out_proj, as the model does

    (x ``[B, L, H, P]``; K = ``d_state`` N, V = ``head_dim`` P.)

    Example (K = V = 1, q = k = 1, scale 1, decay ``exp(a) = 0.5``: ``S <- S / 2 + v``; documents
    of lengths 3 and 2, then one pad token)::

        >>> doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0]])
        >>> ones = torch.ones(1, 6, 1, 1)
        >>> v = torch.tensor([4.0, 4, 4, 2, 2, 8]).view(1, 6, 1, 1)
        >>> a = torch.full((1, 6, 1), -0.6931471805599453)
        >>> o = gla(ones, ones, v, a, PackedContext(doc_ids), scale=1.0)
        >>> [round(x, 4) for x in o.flatten().tolist()]
        [4.0, 6.0, 7.0, 2.0, 3.0, 8.0]
    """
    check_context(ctx, fn="gla")
    check_gla_inputs(q, k, v, a, ctx.local_seq_len, ctx.batch_size)
    chunk_size = check_power_of_two(chunk_size, "chunk_size", fn="gla")
    backend = choose_backend("gla", backend, BACKENDS, "chunked")
    scale = default_scale(q.shape[-1], scale)
    q, k, v, a = (finite_or_zero(t) for t in (q, k, v, a))
    if backend == "chunked":
        run = gla_keyed_chunked if a.dim() == 4 else gla_chunked
    else:
        from fcp.ops.gla import fla  # imported on use: a CUDA-only path

        if not q.is_cuda:
            raise ValueError(f"gla: backend={backend!r} needs CUDA tensors, got {q.device}")
        if chunk_size not in fla.FLA_CHUNK_SIZES:
            raise ValueError(
                f"gla: backend={backend!r} needs chunk_size in {fla.FLA_CHUNK_SIZES}, got "
                f"{chunk_size}"
            )
        if a.dim() == 4:
            from fcp.ops.gla import fla_keyed

            run = fla_keyed.gla_keyed_fla_static
        else:
            run = fla.gla_fla_static
    with autocast_off(q.device):
        out = run(q, k, v, a, ctx, scale, chunk_size)
    return zero_nonfinite_grad(out)
