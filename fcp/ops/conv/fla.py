"""The short conv on FLA's ``causal_conv1d`` kernel (CUDA): the ``"fla_varlen"`` backend.

FLA's conv kernel knows documents only through ``cu_seqlens``, whose launch grid (and ``dweight``
scratch) grows with the number of segments, so it cannot serve a static-shape, CUDA-graph-safe
path; fcp's default ``"masked"`` backend is that path (Inductor fuses it into one memory-bound
pass). This backend runs FLA's kernel with host-side ``cu_seqlens`` per row and, under CP, FLA's
own single-hop halo exchange: every shard needs at least ``width - 1`` tokens.

Ops (CUDA only, fake kernels, autograd through ``register_autograd``):
``fcp::fla_conv_varlen_fwd`` / ``fcp::fla_conv_varlen_bwd``. Written against fla-core 0.6.0's
``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` and ``CausalConv1dFunctionCP``'s two static
helpers (internal APIs; the GPU tests catch a signature change).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fcp.context import PackedContext
from fcp.ops.kit.fla import build_fla_cp_context, contiguous_or_none, device_guard, empty
from fcp.ops.kit.fla import grad_like, group_name, make_fla_cp_context

__all__ = ["fla_conv_varlen_fwd", "short_conv_fla_varlen"]


def _fla_activation(activation: str) -> Optional[str]:
    return activation or None


def _grad_or_zeros(grad: Optional[Tensor], like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _conv_cp_state_shape(x, weight, cu_seqlens, group_name, is_first_rank):
    d, w = weight.shape
    if group_name and not is_first_rank and w > 1:
        return (cu_seqlens.shape[0] - 1, d, w)
    return (0, d, w)


@torch.library.custom_op("fcp::fla_conv_varlen_fwd", mutates_args=(), device_types="cuda")
def fla_conv_varlen_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], cu_seqlens: Tensor,
                        cu_seqlens_cpu: Tensor, activation: str, group_name: str,
                        pre_num_conv_tokens: int, is_first_rank: bool) -> tuple[Tensor, Tensor]:
    """FLA ``causal_conv1d`` forward on one row ``[1, T, D]``: ``(y, initial_state)``.

    ``weight [D, W]`` (``weight[:, -1]`` multiplies the current token), ``activation`` ``""`` or
    ``"silu"``/``"swish"``. With ``group_name``: FLA's CP halo exchange (single hop: every shard
    needs ``>= W - 1`` tokens); ``initial_state`` ``[segments, D, W]`` is the received halo, kept
    for the backward (empty on the first rank and without CP).
    """
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

    x, weight, bias = x.contiguous(), weight.contiguous(), contiguous_or_none(bias)
    state = None
    with device_guard(x):
        if group_name:
            from fla.modules.causal_conv1d.cp import CausalConv1dFunctionCP

            cp = make_fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, None, None,
                                 is_first_rank, None, weight.shape[1], pre_num_conv_tokens)  # fmt: skip
            state = CausalConv1dFunctionCP._prepare_initial_state_for_cp(
                x=x, weight=weight, cu_seqlens=cu_seqlens, context=cp, group=cp.group
            )
        y, _ = causal_conv1d_fwd(
            x=x, weight=weight, bias=bias, residual=None, initial_state=state,
            output_final_state=False, activation=_fla_activation(activation),
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        )
    if state is None:
        state = x.new_zeros(_conv_cp_state_shape(x, weight, cu_seqlens, "", True))
    return y.contiguous(), state.contiguous()


@fla_conv_varlen_fwd.register_fake
def _(x, weight, bias, cu_seqlens, cu_seqlens_cpu, activation, group_name, pre, first):
    shape = _conv_cp_state_shape(x, weight, cu_seqlens, group_name, first)
    return x.new_empty(x.shape), x.new_empty(shape)


@torch.library.custom_op("fcp::fla_conv_varlen_bwd", mutates_args=(), device_types="cuda")
def fla_conv_varlen_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Tensor,
                        dy: Tensor, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor, activation: str,
                        group_name: str, pre_num_conv_tokens: int,
                        is_first_rank: bool) -> tuple[Tensor, Tensor, Tensor]:
    """FLA ``causal_conv1d`` backward: ``(dx, dweight, dbias)`` (``dbias`` empty without bias)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    x, weight, bias = x.contiguous(), weight.contiguous(), contiguous_or_none(bias)
    state = initial_state if initial_state.numel() else None
    with device_guard(x):
        dx, dw, db, _, dh0 = causal_conv1d_bwd(
            x=x, dy=dy.contiguous(), dht=None, weight=weight, bias=bias, residual=None,
            initial_state=state, activation=_fla_activation(activation), cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
        if group_name:
            from fla.modules.causal_conv1d.cp import CausalConv1dFunctionCP

            cp = make_fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, None, None,
                                 is_first_rank, None, weight.shape[1], pre_num_conv_tokens)  # fmt: skip
            CausalConv1dFunctionCP._correct_dx_for_cp(
                dx=dx, dh0=dh0, W=weight.shape[1], group=cp.group, cp_context=cp
            )
    db = db.contiguous() if bias is not None else empty(x.device, x.dtype)
    return dx.contiguous(), dw.contiguous(), db


@fla_conv_varlen_bwd.register_fake
def _(x, weight, bias, initial_state, dy, cu_seqlens, cu_seqlens_cpu, activation, group_name, pre,
      first):  # fmt: skip
    db = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _conv_setup(ctx, inputs, output):
    x, weight, bias, cu, cu_cpu, *meta = inputs
    _, state = output
    ctx.save_for_backward(x, weight, bias, state, cu, cu_cpu)
    ctx.meta = tuple(meta)
    ctx.mark_non_differentiable(state)


def _conv_backward(ctx, dy, _dstate):
    x, weight, bias, state, cu, cu_cpu = ctx.saved_tensors
    dy = _grad_or_zeros(dy, x)
    dx, dw, db = fla_conv_varlen_bwd(x, weight, bias, state, dy, cu, cu_cpu, *ctx.meta)
    return dx, dw, (db if bias is not None else None), None, None, None, None, None, None


fla_conv_varlen_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


def short_conv_fla_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          ctx: PackedContext, activation: str | None = None) -> torch.Tensor:
    """The ``"fla_varlen"`` backend of :func:`fcp.ops.conv.short_conv` (arguments checked there;
    no dilation).

    Guarantees: exact per-document resets (FLA's kernel rounding); host-side metadata per batch
    (synchronises once per batch; its integers specialise a compiled graph: not CUDA-graph safe).
    FLA's halo is single-hop: under CP every shard needs ``width - 1`` tokens (``ValueError``).
    """
    width = weight.shape[1]
    name = group_name(ctx)
    if name and ctx.local_seq_len < width - 1:
        raise ValueError(
            f"FLA's CP conv halo is single-hop: local_seq_len={ctx.local_seq_len} < "
            f"width - 1 = {width - 1}; use backend='masked' instead"
        )
    outs = []
    for row in range(x.shape[0]):
        fla_ctx = build_fla_cp_context(ctx, row, ctx.group if name else None, width)
        y, _ = fla_conv_varlen_fwd(
            x[row : row + 1], weight, bias, fla_ctx.cu_seqlens, fla_ctx.cu_seqlens_cpu,
            activation or "", name, int(fla_ctx.pre_num_conv_tokens), bool(fla_ctx.is_first_rank),
        )  # fmt: skip
        outs.append(y)
    return torch.cat(outs, 0)
