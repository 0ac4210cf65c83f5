"""fcp's operators, one folder each (``fcp/ops/<operator>/``): ``reference.py`` (the definition
and test oracle: only tests and other references import it), one module per backend, and the
folder's ``__init__``, the operator's only dispatcher (it checks arguments and chooses a backend
from the ``backend=`` argument, ``"auto"`` by default; each backend's docstring states its
guarantees). No operator folder imports another.

* :mod:`.conv` - :func:`~fcp.ops.conv.short_conv` (causal, optionally dilated, conv);
* :mod:`.kda` - :func:`~fcp.ops.kda.kda` (Kimi Delta Attention and Gated DeltaNet);
* :mod:`.gla` - :func:`~fcp.ops.gla.gla` (gated linear attention with a scalar decay per head:
  Mamba2's SSD);
* :mod:`.elementwise_scan` - :func:`~fcp.ops.elementwise_scan.elementwise_scan` (the diagonal
  linear recurrence ``h = a h + x`` per channel: RecurrentGemma's RG-LRU);
* :mod:`.wkv` - :func:`~fcp.ops.wkv.wkv` (RWKV-4's WKV: two decayed sums with a bonus, their
  stabiliser carried as a running max); :mod:`.mlstm` -
  :func:`~fcp.ops.mlstm.mlstm_stabilizer` (xLSTM's mLSTM max stabiliser across documents and
  ranks; its memory is :func:`~fcp.ops.gla.gla`);
* :mod:`.doc_causal` - :func:`~fcp.ops.doc_causal.doc_causal_attention` (softmax attention
  causal within each document);
* :mod:`.sliding_window` - :func:`~fcp.ops.sliding_window.sliding_window_attention` (the same
  within the last ``window`` tokens, its K/V halo crossing ranks; attention sinks, soft-capping);
* :mod:`.relative_attention` - :func:`~fcp.ops.relative_attention.relative_attention` (softmax
  attention within documents plus a per-query bias over the backward distance: Inkling-2);
* :mod:`.compressed` - :func:`~fcp.ops.compressed.compressed_attention` (attention over K/V block
  means);
* :mod:`.kpool_indexer` (GLM-5.3-Flash's DSA k-pool indexer) and :mod:`.qsa_indexer`
  (Qwen3.8-Flash-Next's QSA selection): global token ids that :mod:`.index_attention` attends,
  or :mod:`.latent_attention` (MLA over the selected tokens, its latent gathered);
* :mod:`.pooled_attention` - DeepSeek-V4's compressed attention: softmax-gated
  document-aligned pools (:func:`~fcp.ops.pooled_attention.gated_pools`), the lightning
  indexer's pool choice (:func:`~fcp.ops.pooled_attention.pool_select`) and one softmax over an
  exact window, the pools and sinks (:func:`~fcp.ops.pooled_attention.pooled_window_attention`);
* :mod:`.token_indexer` - :func:`~fcp.ops.token_indexer.token_indexer` (the token-level DSA
  "lightning" indexer of GLM-5 / DeepSeek-V3.2: top-k single tokens per query);
* :mod:`.token_lags` - :func:`~fcp.ops.token_lags.token_lags` (each token's ``size - 1``
  predecessors in its document, ``fill`` outside it: grouped convs, token shifts, per-token
  conv taps);
* :mod:`.token_history` - each token's preceding ids inside its document (hashed n-gram
  embeddings).

:mod:`.kit` holds what several operators share (backend choice, scale, compute dtype, isolation
of non-finite values, the recurrence kit, the banded softmax and its masks, FlexAttention,
document-aligned pools, norms, FLA plumbing), so that no operator imports another.
"""

# The operators are imported from their folders (``fcp.ops.kda.kda``, ...) or from ``fcp``; this
# package re-exports nothing, so ``fcp.ops.kda`` stays the module, not the function.
