"""The operators' toolkit: what several operator folders share, so that no operator imports
another and nothing is copied between them.

* :mod:`.common` - backend choice, default scale, compute dtype, isolation of non-finite values;
* :mod:`.recurrence` - the recurrence kit: run numbering, masked exponentials, the WY block
  hierarchy, the diagonal-plus-low-rank chunk transition and its wiring to the CP state chain;
* :mod:`.attention` - the q/k/v rule, the softmax backend choice, backward anchors;
* :mod:`.softmax` - the dense masked fp32 softmax, banded by the context's ``band`` (every device);
* :mod:`.gather` - attention over gathered selected slots (``index_attention``,
  ``latent_attention``);
* :mod:`.flex` - FlexAttention with the same masks (CUDA);
* :mod:`.masks` - attention masks from the replicated doc-id map;
* :mod:`.pools` - document-aligned pools under CP and the selection pipeline of both indexers;
* :mod:`.norms` - zero-centred RMSNorm and rotate-half RoPE in the model's dtype;
* :mod:`.fla` - FLA planning and custom-op plumbing shared by the FLA backends;
* :mod:`.loops` - float64 per-query helpers of the attention references (tests only).
"""
