"""fcp's operators, one folder each (``fcp/ops/<operator>/``): ``reference.py`` (the definition
and test oracle: only tests and other references import it), one module per backend, and the
folder's ``__init__``, the operator's only dispatcher (it checks arguments and chooses a backend
from the ``backend=`` argument, ``"auto"`` by default; each backend's docstring states its
guarantees). No operator folder imports another.

* :mod:`.conv` - :func:`~fcp.ops.conv.short_conv` (causal, optionally dilated, conv);
* :mod:`.kda` - :func:`~fcp.ops.kda.kda` (Kimi Delta Attention and Gated DeltaNet);
* :mod:`.gla` - :func:`~fcp.ops.gla.gla` (gated linear attention with a scalar decay per head:
  Mamba2's SSD);
* :mod:`.doc_causal` - :func:`~fcp.ops.doc_causal.doc_causal_attention` (softmax attention
  causal within each document);
* :mod:`.sliding_window` - :func:`~fcp.ops.sliding_window.sliding_window_attention` (the same
  within the last ``window`` tokens, its K/V halo crossing ranks; attention sinks, soft-capping);
* :mod:`.compressed` - :func:`~fcp.ops.compressed.compressed_attention` (attention over K/V block
  means);
* :mod:`.kpool_indexer` (GLM-5.3-Flash's DSA k-pool indexer) and :mod:`.qsa_indexer`
  (Qwen3.8-Flash-Next's QSA selection): global token ids that :mod:`.index_attention` attends,
  or :mod:`.latent_attention` (MLA over the selected tokens, its latent gathered);
* :mod:`.token_history` - each token's preceding ids inside its document (hashed n-gram
  embeddings).

:mod:`.kit` holds what several operators share (backend choice, scale, compute dtype, isolation
of non-finite values, the recurrence kit, the banded softmax and its masks, FlexAttention,
document-aligned pools, norms, FLA plumbing), so that no operator imports another.
"""

# The operators are imported from their folders (``fcp.ops.kda.kda``, ...) or from ``fcp``; this
# package re-exports nothing, so ``fcp.ops.kda`` stays the module, not the function.
