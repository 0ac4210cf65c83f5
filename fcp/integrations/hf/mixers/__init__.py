"""fcp mixer kinds: one module per kind of token mixer, each an
:class:`~fcp.integrations.hf.core.FcpMixer` whose ``fcp_forward`` is the packed-document,
contiguous-CP computation, written as a few overridable steps (``fcp_*`` methods) that a model's
adapter (:mod:`fcp.integrations.hf.families`) fills in or changes. Each kind's steps are a
:class:`typing.Protocol` of :mod:`.protocols` (:data:`STEPS`), one contract per step name.

* :class:`KdaMixer` (:mod:`.kda`): short conv + Kimi Delta Attention + gated norm.
* :class:`GatedDeltaNetMixer` (:mod:`.gdn`): short conv + Gated DeltaNet + SiLU-gated norm.
* :class:`MlaMixer`, :class:`IndexedMlaMixer` (:mod:`.mla`): full and k-pool DSA indexed MLA.
* :class:`GqaMixer` (:mod:`.gqa`): grouped-query attention, RoPE at document-local positions.
* :class:`SsdMixer` (:mod:`.mamba2`): Mamba2's conv over ``[x | B | C]`` + SSD (gated linear
  attention) + D skip + gated RMSNorm.
* :class:`Mamba1Mixer` (:mod:`.mamba1`): Mamba1's conv over x + selective scan (gated linear
  attention with a decay per key) + D skip + SiLU gate.
* :class:`GatedShortConvMixer` (:mod:`.short_conv`): LFM2's gated depthwise short conv.
* :class:`LightningMixer` (:mod:`.lightning`): MiniMax's lightning attention (linear attention
  with a constant per-head decay, as gated linear attention) + RMSNorm + sigmoid output gate.
* :class:`QsaGqaMixer` (:mod:`.qsa`): grouped-query attention over a QSA token selection.
* :class:`PleMixer` (:mod:`.ple`): Per-Layer Embeddings (hashed n-grams of each document's own
  token history, dilated conv).
* :class:`RglruMixer` (:mod:`.rglru`): Griffin's recurrent block (RecurrentGemma): short conv +
  RG-LRU as an elementwise scan.
* :class:`WkvMixer`, :class:`TokenShiftFfnMixer` (:mod:`.rwkv`): RWKV-4's time mixing (token
  shift + WKV + receptance gate) and channel mixing (token shift + squared-ReLU MLP).
* :class:`MlstmMixer` (:mod:`.mlstm`): xLSTM's mLSTM (matrix memory as gated linear attention
  scaled by the max stabiliser, a max-plus scan).
"""

from fcp.integrations.hf.mixers.gdn import GatedDeltaNetMixer
from fcp.integrations.hf.mixers.gqa import GqaMixer
from fcp.integrations.hf.mixers.kda import KdaMixer
from fcp.integrations.hf.mixers.lightning import LightningMixer
from fcp.integrations.hf.mixers.mamba1 import Mamba1Mixer
from fcp.integrations.hf.mixers.mamba2 import SsdMixer
from fcp.integrations.hf.mixers.mla import IndexedMlaMixer, MlaMixer
from fcp.integrations.hf.mixers.mlstm import MlstmMixer
from fcp.integrations.hf.mixers.ple import PleMixer
from fcp.integrations.hf.mixers.protocols import GdnSteps, GqaSteps, IndexedMlaSteps, KdaSteps
from fcp.integrations.hf.mixers.protocols import MlaSteps, PleSteps, QsaSteps, ShortConvSteps
from fcp.integrations.hf.mixers.protocols import LightningSteps, SsdSteps
from fcp.integrations.hf.mixers.protocols import RglruSteps
from fcp.integrations.hf.mixers.protocols import Mamba1Steps
from fcp.integrations.hf.mixers.protocols import MlstmSteps, TokenShiftFfnSteps, WkvSteps
from fcp.integrations.hf.mixers.qsa import QsaGqaMixer
from fcp.integrations.hf.mixers.rglru import RglruMixer
from fcp.integrations.hf.mixers.rwkv import TokenShiftFfnMixer, WkvMixer
from fcp.integrations.hf.mixers.short_conv import GatedShortConvMixer

__all__ = ["STEPS", "GatedDeltaNetMixer", "GatedShortConvMixer", "GqaMixer", "IndexedMlaMixer",
           "KdaMixer", "LightningMixer", "Mamba1Mixer", "MlaMixer", "PleMixer", "QsaGqaMixer",
           "RglruMixer", "SsdMixer", "TokenShiftFfnMixer", "WkvMixer", "MlstmMixer"]  # fmt: skip

#: mixer kind -> the protocol of its ``fcp_*`` steps (a subclass of a kind, an adapter, keeps its
#: kind's; a subclass kind, e.g. :class:`QsaGqaMixer` of :class:`GqaMixer`, has a sub-protocol)
STEPS = {KdaMixer: KdaSteps, GatedDeltaNetMixer: GdnSteps, GqaMixer: GqaSteps,
         QsaGqaMixer: QsaSteps, SsdMixer: SsdSteps, GatedShortConvMixer: ShortConvSteps,
         MlaMixer: MlaSteps, IndexedMlaMixer: IndexedMlaSteps, PleMixer: PleSteps,
         RglruMixer: RglruSteps, LightningMixer: LightningSteps,
         Mamba1Mixer: Mamba1Steps, WkvMixer: WkvSteps,
         TokenShiftFfnMixer: TokenShiftFfnSteps, MlstmMixer: MlstmSteps}  # fmt: skip
