"""Qwen3.8-Flash-Next seed adapter: see :mod:`fcp.models.qwen3_8_flash_next.cp`."""

from fcp.models.qwen3_8_flash_next.cp import (
    Qwen3_8_FlashNextCPContext,
    packed_boundaries_from_seq_lens,
    qwen3_8_flash_next_cp_all_gather,
    qwen3_8_flash_next_cp_left_halo,
    shard_batch_for_qwen3_8_flash_next_cp,
)

__all__ = [
    "Qwen3_8_FlashNextCPContext",
    "packed_boundaries_from_seq_lens",
    "qwen3_8_flash_next_cp_all_gather",
    "qwen3_8_flash_next_cp_left_halo",
    "shard_batch_for_qwen3_8_flash_next_cp",
]
