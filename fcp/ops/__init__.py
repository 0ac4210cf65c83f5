"""fcp's operators, one folder each: ``reference.py`` (the definition and test oracle), the exact
PyTorch path, the CUDA path, and the folder's ``__init__`` as the operator's only dispatcher
(``backend=`` argument, ``"auto"`` by default; each backend states its guarantees).

* :func:`short_conv` (:mod:`.conv`), :func:`kda` (:mod:`.kda`), :func:`gla` (:mod:`.gla`: gated
  linear attention with a scalar decay per head, Mamba2's SSD);
* :func:`doc_causal_attention`, :func:`compressed_attention` (:mod:`.attention`);
* :func:`kpool_indexer` (GLM-5.3-Flash's DSA), :func:`qsa_indexer` (Qwen3.8-Flash-Next's QSA) and
  the :func:`index_attention` both feed (:mod:`.kpool_indexer`, :mod:`.qsa_indexer`,
  :mod:`.index_attention`).

:mod:`.common` holds the rules they share (backend names, scale, compute dtype, isolation of
non-finite values); :mod:`.fla_support` what the FLA backends share; :mod:`.doc_pools` the
document-aligned pools both indexers score.
"""

# The operators are imported from their folders (``fcp.ops.kda.kda``, ...) or from ``fcp``; this
# package re-exports nothing, so ``fcp.ops.kda`` stays the module, not the function.
