"""Softmax attention operators for packed documents, exact under contiguous CP.

One folder per operator, each with its definition (``reference.py``) and its ``__init__`` as the
only dispatcher:

* :mod:`.doc_causal` - causal attention within each document (all-gathered K/V);
* :mod:`.compressed` - same-document block means plus an exact sliding window (all-gathers only
  the compressed K/V, plus a ``window - 1`` left halo).

Attention over indexer-selected tokens (GLM-5.3-Flash's DSA, Qwen3.8-Flash-Next's QSA) is its
own operator: :mod:`fcp.ops.index_attention`, fed by :mod:`fcp.ops.kpool_indexer` or
:mod:`fcp.ops.qsa_indexer`.

Shared pieces: :mod:`.checks` (arguments, backend choice), :mod:`.masks` (masks from the
replicated doc-id map), :mod:`.dense` (the masked fp32 softmax, every device) and :mod:`.flex`
(FlexAttention, CUDA).

Shapes: ``q [batch, local_seq, heads, D]``, ``k``/``v`` ``[batch, local_seq, kv_heads, D]`` (GQA),
output like ``q``. Softmax in fp32, output in ``q``'s dtype, default scale ``D ** -0.5``. Pad
tokens (doc id 0) are never visible; pad queries give zeros. All masks come from the replicated
doc-id map with static shapes (no host sync; no recompilation when the packing changes).
``backend="auto"`` is FlexAttention for CUDA tensors and the dense backend elsewhere.
"""

from fcp.ops.attention.checks import BACKENDS
from fcp.ops.attention.compressed import compressed_attention
from fcp.ops.attention.doc_causal import doc_causal_attention

__all__ = ["BACKENDS", "compressed_attention", "doc_causal_attention"]
