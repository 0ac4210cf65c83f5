"""RWKV-4's layers (transformers' ``RwkvSelfAttention``, "time mixing", and ``RwkvFeedForward``,
"channel mixing") on fcp's operators.

Both mix each token with the previous one (the *token shift*: transformers'
``nn.ZeroPad2d((0, 0, 1, -1))``, zeros before the row's first token), which in a packed row must
be the previous token *of the same document*, zeros at a document start:
:func:`~fcp.ops.token_lags.token_lags` with two entries (a one-token left halo under CP).

:class:`WkvMixer` (``fcp_forward(hidden_states [B, L, D], ctx) -> (out [B, L, D], None)``)::

    xx = token_shift(x)                                   # the previous token of the document
    k = key(x * mix_k + xx * (1 - mix_k))                 # mix_* = time_mix_key, _value, ...
    v = value(x * mix_v + xx * (1 - mix_v))
    r = sigmoid(receptance(x * mix_r + xx * (1 - mix_r)))
    out = output(r * wkv(k, v, -exp(time_decay), time_first))   # fcp.ops.wkv, fp32 inside

:class:`TokenShiftFfnMixer` (the same contract)::

    xx = token_shift(x)
    k = relu(key(x * mix_k + xx * (1 - mix_k))) ** 2
    out = sigmoid(receptance(x * mix_r + xx * (1 - mix_r))) * value(k)

Both return ``(out, None)``: transformers' layers return ``(out, state)``, and fcp keeps no
recurrent state across calls (a ``state`` argument is refused). Under CP a time-mixing layer
exchanges a one-token halo of its input and the WKV's two tiny all-gathers (the running maxima,
fp32 ``[B, A]``, and the state chain, fp32 ``[B, A, 1, 3]``; ``A`` the attention width); a
channel-mixing layer a one-token halo.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.ops.token_lags import token_lags
from fcp.ops.wkv import wkv

__all__ = ["TokenShiftFfnMixer", "WkvMixer"]


def _shift(x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``[B, L, D]``: the previous token of each token's document, zeros at a document start."""
    return token_lags(x, ctx, 2)[:, :, 1]


def _no_state(module, state) -> None:
    if state is not None:
        raise ValueError(f"{type(module).__name__}: fcp runs full packed sequences; a recurrent "
                         "`state` cannot be given with cp_context")  # fmt: skip


class WkvMixer(FcpMixer):
    """RWKV-4's time mixing: token shift, WKV, receptance gate (module doc)."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *, state=None,
                    **_) -> tuple[torch.Tensor, None]:  # fmt: skip
        _no_state(self, state)
        x = hidden_states
        xx = _shift(x, ctx)
        key = self.key(x * self.time_mix_key + xx * (1 - self.time_mix_key))
        value = self.value(x * self.time_mix_value + xx * (1 - self.time_mix_value))
        gate = x * self.time_mix_receptance + xx * (1 - self.time_mix_receptance)
        receptance = torch.sigmoid(self.receptance(gate))
        y = wkv(key, value, -torch.exp(self.time_decay.float()), self.time_first.float(), ctx)
        return self.output(receptance * y.to(key.dtype)), None


class TokenShiftFfnMixer(FcpMixer):
    """RWKV-4's channel mixing: token shift, squared-ReLU MLP, receptance gate (module doc)."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *, state=None,
                    **_) -> tuple[torch.Tensor, None]:  # fmt: skip
        _no_state(self, state)
        x = hidden_states
        xx = _shift(x, ctx)
        key = torch.square(torch.relu(self.key(x * self.time_mix_key
                                               + xx * (1 - self.time_mix_key))))  # fmt: skip
        gate = x * self.time_mix_receptance + xx * (1 - self.time_mix_receptance)
        return torch.sigmoid(self.receptance(gate)) * self.value(key), None
