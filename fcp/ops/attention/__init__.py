"""Softmax attention operators for packed documents, exact under contiguous CP.

* :func:`doc_causal_attention` - causal attention within each document (all-gathered K/V).
* :func:`compressed_attention` - same-document block means plus an exact sliding window
  (all-gathers only the compressed K/V, plus a ``window - 1`` left halo).
* :func:`sparse_attention` - indexer-selected top-k earlier blocks plus the own block
  (pooled-key DSA; all-gathers pooled index keys and K/V).

Shapes: ``q [batch, local_seq, heads, D]``, ``k``/``v`` ``[batch, local_seq, kv_heads, D]`` (GQA),
output like ``q``. Softmax in fp32, output in ``q``'s dtype, default scale ``D ** -0.5``. Pad
tokens (doc id 0) are never visible; pad queries give zeros. All masks come from the replicated
doc-id map with static shapes (no host sync; no recompilation when the packing changes).

Backends: dense masked fp32 (:mod:`.dense`, runs everywhere, used on CPU) and FlexAttention
(:mod:`.flex`) picked automatically for CUDA tensors where available.
"""

from fcp.ops.attention.compressed import compressed_attention
from fcp.ops.attention.doc_causal import doc_causal_attention
from fcp.ops.attention.sparse import sparse_attention

__all__ = ["compressed_attention", "doc_causal_attention", "sparse_attention"]
