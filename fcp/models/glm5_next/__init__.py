"""GLM-5.3-Flash seed adapter: see :mod:`fcp.models.glm5_next.cp`."""

from fcp.models.glm5_next.cp import (
    Glm5NextPackedContext,
    all_gather_backward_anchor,
    all_gather_sequence,
    build_fla_cp_context,
    doc_ids_from_cu_seqlens,
    doc_ids_from_seq_lens,
    segment_cu_seqlens,
    shard_batch_for_glm5_next_cp,
)

__all__ = [
    "Glm5NextPackedContext",
    "all_gather_backward_anchor",
    "all_gather_sequence",
    "build_fla_cp_context",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_seq_lens",
    "segment_cu_seqlens",
    "shard_batch_for_glm5_next_cp",
]
