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
* :class:`GatedShortConvMixer` (:mod:`.short_conv`): LFM2's gated depthwise short conv.
* :class:`QsaGqaMixer` (:mod:`.qsa`): grouped-query attention over a QSA token selection.
* :class:`PleMixer` (:mod:`.ple`): Per-Layer Embeddings (hashed n-grams of each document's own
  token history, dilated conv).
"""

from fcp.integrations.hf.mixers.gdn import GatedDeltaNetMixer
from fcp.integrations.hf.mixers.gqa import GqaMixer
from fcp.integrations.hf.mixers.kda import KdaMixer
from fcp.integrations.hf.mixers.mamba2 import SsdMixer
from fcp.integrations.hf.mixers.mla import IndexedMlaMixer, MlaMixer
from fcp.integrations.hf.mixers.ple import PleMixer
from fcp.integrations.hf.mixers.protocols import GdnSteps, GqaSteps, IndexedMlaSteps, KdaSteps
from fcp.integrations.hf.mixers.protocols import MlaSteps, PleSteps, QsaSteps, ShortConvSteps
from fcp.integrations.hf.mixers.protocols import SsdSteps
from fcp.integrations.hf.mixers.qsa import QsaGqaMixer
from fcp.integrations.hf.mixers.short_conv import GatedShortConvMixer

__all__ = ["STEPS", "GatedDeltaNetMixer", "GatedShortConvMixer", "GqaMixer", "IndexedMlaMixer",
           "KdaMixer", "MlaMixer", "PleMixer", "QsaGqaMixer", "SsdMixer"]  # fmt: skip

#: mixer kind -> the protocol of its ``fcp_*`` steps (a subclass of a kind, an adapter, keeps its
#: kind's; a subclass kind, e.g. :class:`QsaGqaMixer` of :class:`GqaMixer`, has a sub-protocol)
STEPS = {KdaMixer: KdaSteps, GatedDeltaNetMixer: GdnSteps, GqaMixer: GqaSteps,
         QsaGqaMixer: QsaSteps, SsdMixer: SsdSteps, GatedShortConvMixer: ShortConvSteps,
         MlaMixer: MlaSteps, IndexedMlaMixer: IndexedMlaSteps, PleMixer: PleSteps}  # fmt: skip
