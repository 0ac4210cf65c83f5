"""Qwen3.8-Flash-Next seed adapter: see :mod:`fcp.models.qwen3_8_flash_next.cp`."""

from fcp.models.qwen3_8_flash_next import cp
from fcp.models.qwen3_8_flash_next.cp import Qwen3_8_FlashNextCPContext
from fcp.models.qwen3_8_flash_next.cp import packed_boundaries_from_seq_lens
from fcp.models.qwen3_8_flash_next.cp import qwen3_8_flash_next_cp_all_gather
from fcp.models.qwen3_8_flash_next.cp import qwen3_8_flash_next_cp_left_halo
from fcp.models.qwen3_8_flash_next.cp import shard_batch_for_qwen3_8_flash_next_cp

__all__ = list(cp.__all__)
