"""Griffin's recurrent block (RecurrentGemma's ``RecurrentGemmaRecurrentBlock``: linear branches,
a short causal conv and the Real-Gated Linear Recurrent Unit) on fcp's operators.

``fcp_forward(hidden_states [B, L, D], ctx) -> (out [B, L, D], None)``::

    x, y = fcp_branches(hidden_states)   # linear_x(h) [B, L, W]; act(linear_y(h)) [B, L, W]
    x = short_conv(x)                    # conv_1d: depthwise, causal, with bias, no activation
    u, a = fcp_rglru_inputs(x, starts)   # the RG-LRU's gated, normalised input and its decay
    h = elementwise_scan(u, a, ctx)      # h_t = a_t h_{t-1} + u_t, restarted at document starts
    out = fcp_rglru_output(h, y)         # linear_out(h * y)

The RG-LRU (transformers' ``RecurrentGemmaRglru``, ``W = lru_width`` channels in
``num_attention_heads`` blocks of ``W / heads``): block-diagonal input and recurrence gates
``i = sigmoid(x W_i + b_i)``, ``r = sigmoid(x W_r + b_r)``, the log decay
``log_a = -8 r softplus(recurrent_param)``, ``a = exp(log_a)``, and the input
``u = x i sqrt(1 - exp(2 log_a))`` except at a document's first token, where ``u = x i`` (the
state restarts there: transformers' ``reset = position_ids == 0``, which is a document start
for a document run alone; fcp takes the starts from the context, never from ``position_ids``).
The square root's derivative is clipped at 1000 as transformers' ``SqrtBoundDerivative`` does
(its gradient is that of the model, not of ``sqrt``). Dtypes are the layer's: the gates and
``u`` in the activations' dtype, the scan's state fp32 (transformers' ``acc_dtype``), ``h``
back in ``u``'s dtype.

Under CP a layer exchanges the conv's ``W_conv - 1``-token left halo of ``[B, L, W]`` and one
fp32 state-chain all-gather of ``[B, W, 1, 2]``. The steps' contracts:
:class:`~.protocols.RglruSteps`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers.common import conv
from fcp.layout import document_starts
from fcp.ops.elementwise_scan import elementwise_scan

__all__ = ["RglruMixer"]

#: transformers' ``_MAX_SQRT_GRADIENT``: the largest derivative of the input normalisation's sqrt
MAX_SQRT_GRADIENT = 1000.0


class _BoundedSqrt(torch.autograd.Function):
    """``sqrt(x)`` whose derivative ``1 / (2 sqrt(x))`` is capped at :data:`MAX_SQRT_GRADIENT`
    (``x`` near 0 where ``a`` is near 1): the backward divides by ``sqrt(max(4x, 1e-6))``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clamp(4.0 * x, min=1.0 / MAX_SQRT_GRADIENT**2))


class RglruMixer(FcpMixer):
    """Griffin's recurrent block: two branches, a short conv and the RG-LRU (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        conv1d = module.conv_1d
        width = conv1d.kernel_size[0]
        if (conv1d.groups != conv1d.in_channels or conv1d.out_channels != conv1d.in_channels
                or conv1d.stride != (1,) or conv1d.dilation != (1,)
                or conv1d.padding != (width - 1,)):  # fmt: skip
            raise NotImplementedError(
                f"{type(module).__name__}: fcp's short conv is a depthwise causal conv (groups = "
                f"channels, stride 1, dilation 1, padding width - 1); conv_1d is {conv1d}")

    def fcp_branches(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear_x(x), act(linear_y(x)))``, each ``[B, L, lru_width]``."""
        return self.linear_x(x), self.act_fn(self.linear_y(x))

    def fcp_rglru_inputs(self, x: torch.Tensor,
                         starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The RG-LRU's gates (module doc): ``(u, a)``, each ``[B, L, W]``, from the conv's
        output ``x [B, L, W]`` and the document starts ``starts`` (bool ``[B, L, 1]``)."""
        lru = self.rg_lru
        b, n, width = x.shape
        heads = lru.num_attention_heads
        blocks = x.reshape(b * n, heads, lru.block_width).transpose(0, 1)  # [H, B L, W / H]

        def gate(weight, bias):  # block-diagonal: head h's block of x times its own matrix
            out = torch.baddbmm(bias[:, None, :], blocks, weight)  # [H, B L, W / H]
            return torch.sigmoid(out.transpose(0, 1).reshape(b, n, width))

        input_gate = gate(lru.input_gate_weight, lru.input_gate_bias)
        recurrence_gate = gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
        log_a = -8.0 * recurrence_gate * F.softplus(lru.recurrent_param)
        a = torch.exp(log_a)
        # sqrt(1 - a^2) with a^2 as exp(2 log_a) (transformers' rounding), 1 at a start
        norm = torch.where(starts, 1.0, _BoundedSqrt.apply(1 - torch.exp(2 * log_a)))
        return x * input_gate * norm.to(x.dtype), a

    def fcp_rglru_output(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``linear_out(h * y)``: ``h``, ``y`` ``[B, L, W]`` -> ``[B, L, D]``."""
        return self.linear_out(h * y)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_):
        x, y = self.fcp_branches(hidden_states)
        x = conv(self.conv_1d, x, ctx, None)
        starts = document_starts(ctx.doc_ids)[:, ctx.seq_start : ctx.seq_end, None]
        u, a = self.fcp_rglru_inputs(x, starts)
        h = elementwise_scan(u, a, ctx)
        return self.fcp_rglru_output(h, y), None
