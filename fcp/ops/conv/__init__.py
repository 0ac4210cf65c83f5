"""Document-masked short causal convolution (the q/k/v pre-mixer), exact under contiguous CP.

* :mod:`.reference` - the definition: ``F.conv1d`` per document (tests only);
* :mod:`.masked` - the exact static-shape PyTorch path (``backend="masked"``, the default);
* :mod:`.fla` - FLA's ``causal_conv1d`` with ``cu_seqlens`` (``backend="fla_varlen"``, CUDA).

:func:`short_conv` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_choice, check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.conv.masked import short_conv_masked
from fcp.ops.kit.common import autocast_off, choose_backend

__all__ = ["ACTIVATIONS", "BACKENDS", "check_conv_inputs", "short_conv"]

#: ``"masked"``: exact PyTorch, every device, static shapes. ``"fla_varlen"``: FLA's kernel with
#: host-side ``cu_seqlens`` (CUDA; single-hop CP halo; no dilation).
BACKENDS = ("masked", "fla_varlen")
ACTIVATIONS = (None, "silu", "swish")


def check_conv_inputs(x, weight, bias, ctx: PackedContext, activation, dilation=1) -> int:
    """Arguments of :func:`short_conv` (the :mod:`fcp.checks` rule); returns ``dilation``.
    ``ctx`` is already checked by the dispatcher (its one :func:`~fcp.context.check_context`)."""
    name = "short_conv"
    dilation = check_positive_int(dilation, "dilation", fn=name)
    check_choice(activation, "activation", ACTIVATIONS, fn=name)
    check_tensor(x, "x", fn=name, kind="float", dim=3, layout="[batch, local_seq, channels]")
    check_tensor(weight, "weight", fn=name, kind="float", dim=2, layout="[channels, width]")
    channels, width = weight.shape
    if x.shape[-1] != channels or width < 1:
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not match x channels {x.shape[-1]}")
    if bias is not None:
        check_tensor(bias, "bias", fn=name, kind="float", shape=(channels,))
    if x.shape[0] != ctx.batch_size or x.shape[1] != ctx.local_seq_len:
        raise ValueError(
            f"{name}: x is [batch={x.shape[0]}, local_seq={x.shape[1]}] but the context has batch "
            f"{ctx.batch_size} and local_seq_len {ctx.local_seq_len}"
        )
    return dilation


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               ctx: PackedContext, activation: str | None = None, *, dilation: int = 1,
               backend: str = "auto") -> torch.Tensor:
    """Depthwise causal conv1d that never mixes two documents.

    Args:
        x: ``[batch, local_seq, channels]``, this rank's shard (any float dtype).
        weight: ``[channels, width]``; ``weight[:, -1]`` multiplies the current token and
            ``weight[:, i]`` the token ``(width - 1 - i) * dilation`` before it (the layout of
            ``nn.Conv1d(groups=channels).weight[:, 0]`` and FLA's ``causal_conv1d``).
        bias: ``[channels]`` or ``None``.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        activation: ``None`` or ``"silu"`` (``"swish"`` is accepted as an alias).
        dilation: spacing of the taps (``nn.Conv1d``'s ``dilation``); the receptive field, and
            under CP the halo, is ``(width - 1) * dilation`` tokens.
        backend: ``"auto"`` (= ``"masked"``), ``"masked"`` or ``"fla_varlen"`` (CUDA,
            ``dilation=1``); see :data:`BACKENDS`.

    Returns:
        ``[batch, local_seq, channels]`` in ``x``'s dtype, accumulated in fp32 (fp64 for fp64).

    Parameter gradients (``weight``, ``bias``) are per-rank partial sums under CP: the
    data-parallel gradient reduction over the CP ranks sums them.

    Example (width 2, weight ``[[1, 1]]``, no bias): ``x = [1, 2, 3]`` with doc ids
    ``[1, 1, 2]`` gives ``[1, 3, 3]``: the third token starts document 2 and sees only itself::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 2]]))
        >>> short_conv(torch.tensor([[[1.0], [2.0], [3.0]]]), torch.ones(1, 2), None, ctx).flatten()
        tensor([1., 3., 3.])
    """
    check_context(ctx, fn="short_conv")
    dilation = check_conv_inputs(x, weight, bias, ctx, activation, dilation)
    backend = choose_backend("short_conv", backend, BACKENDS, "masked")
    if backend == "masked":
        with autocast_off(x.device):
            return short_conv_masked(x, weight, bias, ctx, activation, dilation)
    if not x.is_cuda or dilation != 1:
        raise ValueError(
            f"short_conv: backend='fla_varlen' needs CUDA tensors and dilation=1, got device "
            f"{x.device}, dilation={dilation}"
        )
    from fcp.ops.conv.fla import short_conv_fla_varlen  # imported on use: a CUDA-only path

    with autocast_off(x.device):
        return short_conv_fla_varlen(x, weight, bias, ctx, activation)
