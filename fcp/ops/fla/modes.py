"""KDA and short conv on FLA's kernels, in two modes, plus the device dispatch.

**Static mode** (:func:`fla_kda_static`): compile- and CUDA-graph-safe. The custom op
``fcp::fla_kda_fwd`` runs FLA's *dense* chunked KDA on the whole ``[batch, local_seq]`` shard; no
variable-length metadata exists, so no shape depends on the packing. Documents restart by the gate:
``g`` is replaced by :data:`RESET_LOG_DECAY` (natural log, ``-105``) at every run start of the
replicated doc-id map inside the shard (``torch.where``, so ``dg`` there is an exact 0, which is
also the true gradient: the decay at a document start multiplies a zero state); a run start at
the shard's first token is handled by the initial state instead (see CP below). FLA multiplies gates by
``log2(e)`` and takes chunk-local cumulative sums, so every decay factor that spans a run start has a
log2 exponent ``<= -151.5`` and evaluates to exactly ``0.0`` in fp32 (``2**-150`` is below the smallest
fp32 subnormal), the same 0 a state reset gives: no value ever crosses a document boundary.

Numerical consequence (the only one): within a 64-token chunk, the tokens after a reset carry
cumulative gates offset by ``-151.5 * (number of resets before them in the chunk)``, and FLA forms
within-document decays as differences of those fp32 cumulative sums. The difference is exact in
real arithmetic but rounds at the offset's scale: a relative error of about
``|G| * 2**-24 * ln 2``, i.e. ``~6e-6`` per reset in the chunk (``~1e-5`` for one document start,
``<= ~4e-4`` for a chunk of 64 one-token documents), on fp32; invisible under bf16 (``2**-8``).
Chunks without an interior document start are computed exactly as by FLA's dense kernel. The
gradient of ``g`` at tokens *before* a reset (same chunk) receives rounding-level terms from the
following document (FLA's reverse cumulative sum of ``dg`` includes them; they cancel exactly in
real arithmetic), and the rounding of a document's decays depends on the gates earlier in its
chunk: cross-document terms are exact zeros, but outputs are not *bitwise* independent of other
documents (fcp's pure-PyTorch ``kda`` is). Nothing is ever ``inf``/``NaN``: FLA's
non-``safe_gate`` kernels only exponentiate differences ``<= 0`` (or mask the others with
``where``).

Under CP, static mode composes the state chain *outside* the op: each rank runs the op once on
``v_aug = [v | 0_K]`` from ``h0 = [0 | I_K]`` (``[0 | 0]`` for a row whose shard starts a new
run); by linearity the final state is ``[S_r | M_r]`` (the shard's zero-start state and its
transition) and the last ``K`` output columns are each token's response ``R_t`` to the incoming
state (an interior reset zeroes both, exactly as above).
:func:`fcp.comm.state_chain` turns every rank's ``(M_r, S_r)`` into this rank's incoming state
``S_in`` and ``o = o[..., :V] + R @ S_in``. Cost: value width ``V + K`` instead of ``V`` on
``cp_size > 1`` (the non-CP path runs plain ``V``), plus one ``[B, HV, K, K + V]`` fp32 all-gather.

**FLA-varlen mode** (:func:`fla_kda_varlen`, :func:`fla_short_conv_varlen`): FLA's own
``cu_seqlens`` / ``cp_context`` path (``fcp::fla_kda_varlen_*``, ``fcp::fla_conv_varlen_*``), one
flattened row per call, with the host-side :func:`~fcp.ops.fla.plan.build_fla_cp_context`
(memoised per row). Exact per-document resets; needs host metadata (it synchronises once per batch
and ints specialise a compiled graph), so it is the parity/reference mode, not the CUDA-graph one.

**Short conv, static mode**: FLA's conv kernel knows no documents except through ``cu_seqlens``,
whose launch grid (and ``dweight`` scratch, ``[chunks, D, W]`` fp32) grows with the number of
segments; padding that to a static bound means O(tokens) programs and O(tokens * D * W) scratch.
So static mode uses fcp's own document-masked conv (:func:`fcp.ops.conv.short_conv`, halo by
:func:`fcp.comm.left_halo`, any number of hops), which Inductor fuses into one memory-bound pass,
the same traffic as FLA's kernel. The FLA conv kernel is used in FLA-varlen mode.

**Dispatch** (:func:`fla_kda`, :func:`fla_short_conv`): same signatures as
:func:`fcp.ops.kda.kda` / :func:`fcp.ops.conv.short_conv` plus a keyword ``mode``; FLA on CUDA
(:func:`use_fla`), the pure-PyTorch operators everywhere else.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from fcp.comm import state_chain
from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.conv import short_conv
from fcp.ops.fla import ops as _ops
from fcp.ops.fla.plan import build_fla_cp_context

__all__ = [
    "RESET_LOG_DECAY",
    "MODES",
    "use_fla",
    "fla_kda_eligible",
    "fla_kda",
    "fla_kda_static",
    "fla_kda_varlen",
    "fla_short_conv",
    "fla_short_conv_varlen",
]

RESET_LOG_DECAY = -105.0
"""Natural-log decay written at document starts in static mode (``-151.5`` in FLA's log2 units)."""

MODES = ("static", "varlen")

# Probed at import without importing fla (which costs ~15 s): a module-level constant, so the
# dispatch below is plain Python that Dynamo folds at trace time.
_FLA_INSTALLED = importlib.util.find_spec("fla") is not None
_FLA_DISABLED = os.environ.get("FCP_DISABLE_FLA", "0") not in ("", "0")
_FLA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_fla(tensor: torch.Tensor) -> bool:
    """Whether FLA's kernels serve this tensor: CUDA, bf16/fp16/fp32, FLA installed and not
    disabled by ``FCP_DISABLE_FLA=1``. Static facts only (device, dtype): safe under compile."""
    return (
        _FLA_INSTALLED
        and not _FLA_DISABLED
        and (tensor.is_cuda or _ops.fla_kernels_forced())
        and tensor.dtype in _FLA_DTYPES
    )


def _kda_shapes_ok(q: torch.Tensor, chunk_size: int) -> bool:
    return chunk_size in (32, 64) and q.shape[-1] <= 256


def fla_kda_eligible(q: torch.Tensor, chunk_size: int = 64) -> bool:
    """Whether :func:`fla_kda` would run FLA for these inputs: :func:`use_fla` plus FLA's KDA
    limits (``chunk_size`` 32/64, ``K <= 256``). For wiring ``fcp.ops.kda.kda`` without
    recursion: ``if fla_kda_eligible(q, chunk_size): return fla_kda_static(...)``."""
    return use_fla(q) and _kda_shapes_ok(q, chunk_size)


def _check_kda(q, k, v, g, beta, context: PackedContext) -> None:
    if not isinstance(context, PackedContext):
        raise TypeError(f"context must be a PackedContext, got {type(context).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [batch, seq, heads, K], got {tuple(q.shape)}, {tuple(k.shape)}")
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % h:
        raise ValueError(f"v must be [{b}, {t}, value_heads (multiple of {h}), V], got {tuple(v.shape)}")
    hv = v.shape[2]
    if g.shape != (b, t, hv, dk) or beta.shape != (b, t, hv):
        raise ValueError(
            f"g must be [{b}, {t}, {hv}, {dk}] and beta [{b}, {t}, {hv}], got {tuple(g.shape)} "
            f"and {tuple(beta.shape)}"
        )
    if t != context.local_seq_len or b != context.batch_size:
        raise ValueError(
            f"q is [batch={b}, seq={t}] but the context has batch {context.batch_size} and "
            f"local_seq_len {context.local_seq_len}"
        )


def _check_chunk(chunk_size: int) -> None:
    if chunk_size not in (32, 64):
        raise ValueError(f"FLA's KDA supports chunk_size 32 or 64, got {chunk_size}")


# ---------------------------------------------------------------------------------------------
# static mode
# ---------------------------------------------------------------------------------------------
def reset_gate(g: torch.Tensor, context: PackedContext) -> torch.Tensor:
    """``g`` with :data:`RESET_LOG_DECAY` at every run start *inside* this rank's slice.

    Local position 0 is left alone: the kernel starts each row from its initial state, which is
    zero without CP and, under CP, carries the incoming state only when the shard continues a run
    (:func:`fla_kda_static` masks it otherwise). So a row without interior document starts gets
    FLA's plain dense numerics. Static shapes, no host sync.
    """
    starts = document_starts(context.doc_ids)[:, context.seq_start : context.seq_end]
    interior = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, 1:]], 1)
    reset = torch.full((), RESET_LOG_DECAY, dtype=g.dtype, device=g.device)
    return torch.where(interior[:, :, None, None], reset, g)


def fla_kda_static(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    context: PackedContext,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """KDA by FLA's dense kernel with gate resets (static mode; see the module docstring).

    Same arguments and result as :func:`fcp.ops.kda.kda` (``chunk_size`` 32 or 64). On non-CUDA
    tensors the op runs its pure-PyTorch recurrence, so the composition (resets, CP chain) is
    testable anywhere; that fallback is O(seq) Python steps, meant for tests.
    """
    _check_kda(q, k, v, g, beta, context)
    _check_chunk(chunk_size)
    dk, dv = q.shape[-1], v.shape[-1]
    scale = dk**-0.5 if scale is None else float(scale)
    g = reset_gate(g, context)
    if not context.cp_enabled:
        return _ops.fla_kda_fwd(q, k, v, g, beta, None, scale, chunk_size)[0].to(v.dtype)
    bsz, length, hv = v.shape[:3]
    st = _ops._state_dtype(q.dtype)
    v_aug = torch.cat([v, v.new_zeros(bsz, length, hv, dk)], -1)
    # the incoming state enters only if the shard continues the run before it
    carry = ~document_starts(context.doc_ids)[:, context.seq_start]
    eye = torch.eye(dk, dtype=st, device=q.device) * carry[:, None, None, None].to(st)
    h0 = torch.cat([eye.new_zeros(bsz, hv, dk, dv), eye.expand(bsz, hv, dk, dk)], -1)
    o, ht = _ops.fla_kda_fwd(q, k, v_aug, g, beta, h0, scale, chunk_size)[:2]
    s_in = state_chain(ht[..., dv:], ht[..., :dv], context)  # fp32 [B, HV, K, V]
    out = o[..., :dv].to(st) + torch.einsum("bthk,bhkv->bthv", o[..., dv:].to(st), s_in.to(st))
    return out.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# FLA-varlen mode
# ---------------------------------------------------------------------------------------------
def _group_name(context: PackedContext) -> str:
    return context.group.group_name if context.cp_enabled else ""


def fla_kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    context: PackedContext,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """KDA by FLA's variable-length path (``cu_seqlens``, and FLA's ``cp_context`` under CP).

    One op call per batch row with :func:`build_fla_cp_context` metadata (host-side, memoised).
    Same arguments and result as :func:`fcp.ops.kda.kda`. Under CP this needs CUDA (FLA's CP
    state exchange); without CP the op also runs on CPU (pure-PyTorch fallback).
    """
    _check_kda(q, k, v, g, beta, context)
    _check_chunk(chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    name = _group_name(context)
    outs = []
    for row in range(q.shape[0]):
        ctx = build_fla_cp_context(context, row, context.group if name else None, None)
        meta = (ctx.cu_seqlens, ctx.cu_seqlens_cpu, scale, chunk_size, name,
                int(ctx.pre_num_ranks), int(ctx.post_num_ranks), bool(ctx.is_first_rank),
                bool(ctx.is_last_rank))  # fmt: skip
        xs = (x[row : row + 1] for x in (q, k, v, g, beta))
        outs.append(_ops.fla_kda_varlen_fwd(*xs, *meta)[0])
    return torch.cat(outs, 0).to(v.dtype)


def fla_short_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    context: PackedContext,
    activation: str | None = None,
) -> torch.Tensor:
    """Short conv by FLA's ``causal_conv1d`` with ``cu_seqlens`` (and FLA's CP halo under CP).

    Same arguments and result as :func:`fcp.ops.conv.short_conv`. FLA's halo is single-hop: under
    CP every shard needs at least ``width - 1`` tokens (``ValueError`` otherwise).
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3 or x.shape[-1] != weight.shape[0] or x.shape[0] != context.batch_size:
        raise ValueError(
            f"x must be [batch={context.batch_size}, local_seq, channels={weight.shape[0]}], got "
            f"{tuple(x.shape)}"
        )
    width = weight.shape[1]
    name = _group_name(context)
    if name and context.local_seq_len < width - 1:
        raise ValueError(
            f"FLA's CP conv halo is single-hop: local_seq_len={context.local_seq_len} < "
            f"width - 1 = {width - 1}; use static mode (fcp.ops.conv.short_conv) instead"
        )
    outs = []
    for row in range(x.shape[0]):
        ctx = build_fla_cp_context(context, row, context.group if name else None, width)
        y, _ = _ops.fla_conv_varlen_fwd(
            x[row : row + 1], weight, bias, ctx.cu_seqlens, ctx.cu_seqlens_cpu,
            activation or "", name, int(ctx.pre_num_conv_tokens), bool(ctx.is_first_rank),
        )  # fmt: skip
        outs.append(y)
    return torch.cat(outs, 0)


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------
def fla_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    context: PackedContext,
    scale: float | None = None,
    chunk_size: int = 64,
    *,
    mode: str = "static",
    **kda_kwargs,
) -> torch.Tensor:
    """:func:`fcp.ops.kda.kda` on FLA's kernels where :func:`use_fla` (CUDA), else pure PyTorch.

    ``mode="static"`` (default; compile/CUDA-graph safe) or ``"varlen"`` (FLA's own varlen/CP
    path, host metadata). FLA also needs ``chunk_size`` 32/64 and ``K <= 256``; other shapes take
    the pure-PyTorch path. Extra keywords go to :func:`fcp.ops.kda.kda` only.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if fla_kda_eligible(q, chunk_size):
        fn = fla_kda_static if mode == "static" else fla_kda_varlen
        return fn(q, k, v, g, beta, context, scale, chunk_size)
    from fcp.ops.kda import kda

    return kda(q, k, v, g, beta, context, scale, chunk_size, **kda_kwargs)


def fla_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    context: PackedContext,
    activation: str | None = None,
    *,
    mode: str = "static",
) -> torch.Tensor:
    """:func:`fcp.ops.conv.short_conv`, on FLA's ``causal_conv1d`` for ``mode="varlen"`` on CUDA.

    ``mode="static"`` is fcp's own document-masked conv on every device (FLA's conv kernel cannot
    mask documents with static shapes; see the module docstring).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "varlen" and use_fla(x):
        return fla_short_conv_varlen(x, weight, bias, context, activation)
    return short_conv(x, weight, bias, context, activation)
