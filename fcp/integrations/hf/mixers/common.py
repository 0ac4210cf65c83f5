"""Pieces shared by the recurrent mixer kinds (KDA, Gated DeltaNet): the layer's causal conv on
fcp's document-masked :func:`~fcp.ops.conv.short_conv`, and transformers' in-kernel q/k L2 norm."""

from __future__ import annotations

import torch
from torch import nn

from fcp.context import PackedContext
from fcp.ops.conv import short_conv

__all__ = ["check_silu", "conv", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + eps)`` in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_silu(module: nn.Module, attribute: str = "activation") -> None:
    """fcp's short conv applies SiLU: reject a layer whose conv uses another activation."""
    activation = getattr(module, attribute)
    if activation not in ("silu", "swish"):
        raise NotImplementedError(f"{type(module).__name__}: fcp's short conv applies SiLU; this "
                                  f"layer uses {activation!r}")  # fmt: skip


def conv(module: nn.Conv1d, x: torch.Tensor, ctx: PackedContext, activation: str | None):
    """A depthwise causal ``nn.Conv1d`` (weight ``[C, 1, W]``) over ``x [B, L, C]`` that never
    mixes two documents; its ``W - 1``-token left halo crosses ranks under CP."""
    return short_conv(x, module.weight[:, 0, :], module.bias, ctx, activation=activation)
