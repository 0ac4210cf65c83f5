"""fcp mixer kinds: one module per kind of token mixer, each an
:class:`~fcp.integrations.hf.core.FcpMixer` whose ``fcp_forward`` is the packed-document,
contiguous-CP computation, written as a few overridable steps (``fcp_*`` methods) that a model's
adapter (:mod:`fcp.integrations.hf.models`) fills in or changes.

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
from fcp.integrations.hf.mixers.qsa import QsaGqaMixer
from fcp.integrations.hf.mixers.short_conv import GatedShortConvMixer

__all__ = ["GatedDeltaNetMixer", "GatedShortConvMixer", "GqaMixer", "IndexedMlaMixer", "KdaMixer",
           "MlaMixer", "PleMixer", "QsaGqaMixer", "SsdMixer"]  # fmt: skip
