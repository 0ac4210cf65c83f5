"""Per-token normalisation and rotary pieces in the model's dtype, shared by the QSA indexer's
compute path and its reference (and usable by model adapters).

* :func:`zero_centered_rms_norm` - Qwen3-Next's ``RMSNorm``: ``x * rsqrt(mean(x^2) + eps) *
  (1 + w)`` in fp32, cast back (fp64 stays fp64);
* :func:`rotate_half_rope` - NeoX rotary embedding of the first ``R`` dims, arithmetic in ``x``'s
  dtype, the rest passed through;
* :func:`rope_tables` - ``(cos, sin)`` at given (document-local) positions.

>>> cos, sin = rope_tables(torch.tensor([0, 1]), 2)
>>> rotate_half_rope(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), cos, sin)[:, 1].tolist()[0]
0.0
"""

from __future__ import annotations

import torch

__all__ = ["rope_tables", "rotate_half_rope", "zero_centered_rms_norm"]


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last axis, in fp32, cast back to
    ``x``'s dtype (Qwen3-Next's ``RMSNorm``; fp64 stays fp64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(y.dtype))).to(x.dtype)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary embedding of the first ``R = 2 * cos.shape[-1]`` dims of ``x [..., D]``;
    ``cos``/``sin`` ``[..., R/2]`` broadcast against ``x[..., :R/2]`` and are cast to ``x``'s
    dtype; the arithmetic runs in ``x``'s dtype; dims ``R..D`` pass through."""
    half = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def rope_tables(
                positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[*positions.shape, rotary_dim // 2]``: angles ``pos * theta **
    (-2i / rotary_dim)`` in fp32, cast to ``dtype`` (NeMo's ``freqs_cis`` is ``cat(cos, sin)``).
    Pass document-local positions (``PackedContext.local_position_ids``)."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (exps / rotary_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


