"""The ``fcp_*`` steps of every mixer kind, stated once: one :class:`typing.Protocol` per kind, one
contract per step name across all kinds.

A kind's ``fcp_forward`` calls its steps; a model's adapter overrides the ones where the model
differs, with the protocol's signature (``tests/test_hf_registry.py`` checks every override's
parameter names and kinds against these). A name means the same thing wherever it appears:
``fcp_output(o, x)`` is "per-head output and the layer input -> the layer output" in KDA and MLA
alike, and a step whose arguments differ has its own name (``fcp_gated_output(o, z)`` for Gated
DeltaNet, ``fcp_attention_output(o, gate)`` for GQA, ``fcp_ssd_output(y, z, dtype)`` for Mamba2).

Shapes: ``B`` batch rows, ``L`` local tokens, ``D`` hidden size, ``H`` heads (``HV`` value heads,
``Hkv`` key/value heads), ``K`` / ``V`` / ``Dh`` per-head key, value and head dims. Every step
runs on the transformers module itself (``self`` is the swapped module), so attribute names are
the model's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from fcp.context import PackedContext

__all__ = ["GdnSteps", "GqaSteps", "IndexedMlaSteps", "KdaSteps", "LightningSteps", "Mamba1Steps",
           "MixerSteps", "MlaSteps", "PleSteps", "QsaSteps", "RglruSteps", "ShortConvSteps",
           "SsdSteps", "TokenShiftFfnSteps", "WkvSteps", "MlstmSteps"]  # fmt: skip


class MixerSteps(Protocol):
    """Every fcp mixer (:class:`~fcp.integrations.hf.core.FcpMixer`)."""

    @classmethod
    def fcp_check(cls, module: nn.Module) -> None:
        """Raise ``NotImplementedError`` (before any change) for a configuration of ``module``
        the kind cannot compute."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **kwargs) -> Any:
        """The packed-document, contiguous-CP computation: ``hidden_states [B, L, D]`` -> what
        transformers' ``forward`` returns. A kind may add keyword-only arguments."""


class KdaSteps(MixerSteps, Protocol):
    """Kimi Delta Attention (:mod:`.kda`)."""

    def fcp_conv_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` -> the short conv's input ``[B, L, 3 * qkv_dim]``: ``[q | k | v]``."""

    def fcp_decay(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` -> per-channel log decay ``[B, L, H, K]`` (fp32)."""

    def fcp_beta(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` -> the delta rule's step size ``[B, L, H]``."""

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head output ``o [B, L, H, V]`` and the layer input ``x [B, L, D]`` -> ``[B, L, D]``
        (gate, norm, output projection)."""


class GdnSteps(MixerSteps, Protocol):
    """Gated DeltaNet (:mod:`.gdn`)."""

    def fcp_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, D]`` -> ``(qkv [B, L, 2 key_dim + value_dim], z [B, L, HV, V],
        b [B, L, HV], a [B, L, HV])``: conv input, output gate, beta and decay logits."""

    def fcp_beta_from_logit(self, b: torch.Tensor) -> torch.Tensor:
        """Beta logits ``[B, L, HV]`` -> the delta rule's step size ``[B, L, HV]``."""

    def fcp_decay_from_logit(self, a: torch.Tensor) -> torch.Tensor:
        """Decay logits ``[B, L, HV]`` -> one log decay per value head ``[B, L, HV]`` (fp32)."""

    def fcp_gated_output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``o [B, L, HV, V]`` (fp32) and the gate ``z [B, L, HV, V]`` -> ``[B, L, D]``."""


class GqaSteps(MixerSteps, Protocol):
    """Grouped-query softmax attention (:mod:`.gqa`)."""

    @staticmethod
    def fcp_uses_rope(config: Any) -> bool:
        """Whether the layer of ``config`` rotates q and k (``False``: NoPE)."""

    def fcp_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``x [B, L, D]`` -> ``(q [B, L, H, Dh], k [B, L, Hkv, Dh], v [B, L, Hkv, Dh],
        gate [B, L, H * Dh] | None)``, q and k normalised as the model does."""

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor,
                      ctx: PackedContext) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(q, k)`` rotated at document-local positions (unchanged under NoPE)."""

    def fcp_window(self) -> int | None:
        """The sliding window in tokens (a query sees itself and ``window - 1`` earlier tokens
        of its document) or ``None`` (all of them)."""

    def fcp_sinks(self, x: torch.Tensor) -> torch.Tensor | None:
        """Attention-sink logits ``[H]`` or ``[B, L, H]`` from ``x [B, L, D]``, or ``None``."""

    def fcp_softcap(self) -> float | None:
        """Soft-capping ``c`` of the scaled scores (``c * tanh(s / c)``) or ``None``."""

    def fcp_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                   ctx: PackedContext) -> torch.Tensor:  # fmt: skip
        """``[B, L, H, Dh]``: attention within each query's document (``x [B, L, D]``, the
        layer input, for a selection or sinks that read it)."""

    def fcp_attention_output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o [B, L, H * Dh]`` and ``fcp_qkv``'s gate -> ``[B, L, D]``."""


class QsaSteps(GqaSteps, Protocol):
    """GQA over a QSA token selection (:mod:`.qsa`)."""

    def fcp_index_inputs(self, x: torch.Tensor, ctx: PackedContext) -> tuple[torch.Tensor, ...]:
        """:func:`~fcp.ops.qsa_indexer.qsa_indexer`'s tensors from ``x [B, L, D]``."""

    def fcp_qsa_select(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """int64 ``[B, L, budget + ratio - 1]``: the global token ids each query attends to."""


class SsdSteps(MixerSteps, Protocol):
    """Mamba2's SSD (:mod:`.mamba2`)."""

    def fcp_project(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` -> ``[B, L, intermediate_size + conv_dim + num_heads]``:
        ``[z | x B C | dt]``."""

    def fcp_chunk_size(self) -> int:
        """The chunk size of fcp's scan (rounding only)."""

    def fcp_ssd_output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``y [B, L, H * P]`` (fp32), the gate ``z [B, L, H * P]`` -> ``[B, L, D]`` in
        ``dtype``."""


class LightningSteps(MixerSteps, Protocol):
    """Lightning attention: linear attention with a constant per-head decay (:mod:`.lightning`)."""

    def fcp_lightning_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, D]`` -> ``(q, k, v)``, each ``[B, L, H, Dh]``."""

    def fcp_slopes(self) -> torch.Tensor:
        """``[H]`` fp32: each head's decay rate ``s_h >= 0`` (the state decays by ``exp(-s_h)``
        per token)."""

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`KdaSteps.fcp_output`: ``o [B, L, H, V]``, ``x [B, L, D]`` -> ``[B, L, D]``."""


class Mamba1Steps(MixerSteps, Protocol):
    """Mamba1's selective scan (:mod:`.mamba1`)."""

    def fcp_project(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` -> ``[B, L, 2 * intermediate_size]``: ``[x | z]``."""

    def fcp_ssm_norms(self, dt: torch.Tensor, b: torch.Tensor,
                      c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x_proj``'s ``dt [B, L, time_step_rank]``, ``B``, ``C [B, L, ssm_state_size]`` ->
        the same, as the scan reads them (normalised or not)."""

    def fcp_ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, I]`` (after the conv) -> ``(dt [B, L, I]`` before its bias and softplus,
        ``B``, ``C [B, L, G, N])`` (``G`` groups of channels, each with its own B and C)."""

    def fcp_ssm_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(A [I, N]`` fp32 (``-exp(A_log)``), ``D [I]``, the dt bias ``[I]`` or ``None)``."""

    def fcp_chunk_size(self) -> int:
        """The chunk size of fcp's scan (rounding only)."""


class ShortConvSteps(MixerSteps, Protocol):
    """LFM2's gated short conv (:mod:`.short_conv`): no step besides ``fcp_forward``."""


class MlaSteps(MixerSteps, Protocol):
    """Multi-head latent attention (:mod:`.mla`)."""

    def fcp_query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, L, D]`` -> ``(q [B, L, H, qk_head_dim], q_resid [B, L, q_lora_rank] | None)``."""

    def fcp_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, L, D]`` -> ``(latent [B, L, kv_lora_rank], k_rope [B, L, qk_rope_head_dim])``."""

    def fcp_rotate(self, q: torch.Tensor, k_rope: torch.Tensor,
                   ctx: PackedContext) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(q, k_rope)`` with positions on ``q[..., qk_nope_head_dim:]`` and the shared
        ``k_rope`` (unchanged under NoPE)."""

    def fcp_expand(self, latent: torch.Tensor,
                   k_rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``latent [B, S, kv_lora_rank]`` -> per-head ``(k [B, S, H, qk_head_dim],
        v [B, S, H, v_head_dim])``."""

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`KdaSteps.fcp_output`: ``o [B, L, H, V]``, ``x [B, L, D]`` -> ``[B, L, D]``."""


class IndexedMlaSteps(MlaSteps, Protocol):
    """MLA over a k-pool DSA selection (:mod:`.mla`)."""

    def fcp_select(self, x: torch.Tensor, q_resid: torch.Tensor,
                   ctx: PackedContext) -> torch.Tensor:  # fmt: skip
        """int64 global token ids ``[B, L, W]`` (-1: none) from the DSA indexer."""


class PleSteps(MixerSteps, Protocol):
    """Per-Layer Embeddings (:mod:`.ple`)."""

    def fcp_ngram_ids(self, input_ids: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """``input_ids [B, L]`` -> int64 ``[B, L, ngram_heads]`` rows of the hashed table."""


class RglruSteps(MixerSteps, Protocol):
    """Griffin's recurrent block: short conv + RG-LRU (:mod:`.rglru`)."""

    def fcp_branches(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, L, D]`` -> ``(x [B, L, W], y [B, L, W])``: the recurrence branch (the conv's
        input) and the output gate branch, its activation applied."""

    def fcp_rglru_inputs(self, x: torch.Tensor,
                         starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The conv's output ``x [B, L, W]`` and the document starts (bool ``[B, L, 1]``) ->
        ``(u, a)``, ``[B, L, W]`` each: the scan's input and multiplicative decay
        (:func:`~fcp.ops.elementwise_scan.elementwise_scan`)."""

    def fcp_rglru_output(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The scan's output ``h [B, L, W]`` and the gate branch ``y [B, L, W]`` ->
        ``[B, L, D]``."""


class WkvSteps(MixerSteps, Protocol):
    """RWKV-4's time mixing (:mod:`.rwkv`): no step besides ``fcp_forward``, which returns
    ``(out [B, L, D], None)`` as transformers' layer returns ``(out, state)``."""


class TokenShiftFfnSteps(MixerSteps, Protocol):
    """RWKV-4's channel mixing (:mod:`.rwkv`): no step besides ``fcp_forward`` (as
    :class:`WkvSteps`)."""


class MlstmSteps(MixerSteps, Protocol):
    """xLSTM's mLSTM (:mod:`.mlstm`)."""

    def fcp_mlstm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, D]`` -> ``(q, k [B, L, H, K], v [B, L, H, V], o [B, L, H * V],
        i, f [B, L, H])``: projections, output-gate and soft-capped gate preactivations."""
