"""TRL's ``SFTTrainer`` on packed documents with contiguous CP: :class:`PackedCPSFTTrainer`.

Imported only when TRL is installed (``fcp.integrations.hf.PackedCPSFTTrainer`` resolves it on
first use). Everything but the base class is :class:`~fcp.integrations.hf.trainer.PackedCP`;
TRL's own loss (its fused LM head scores ``shift_labels`` without shifting, normalised by
``num_items_in_batch``, then ``* world`` before DDP averages) is the one-process loss once the
batches are sharded and counted as ``PackedCP`` does. A script changes in three places::

    from fcp.integrations.hf import PackedCPSFTTrainer       # 1. instead of SFTTrainer
    trainer = PackedCPSFTTrainer(model=model, args=SFTConfig(packing=True, ...),  # 2. packing
                                 train_dataset=ds, cp_size=2)                      # 3. CP size
    trainer.train()
"""

from __future__ import annotations

from trl import SFTTrainer

from fcp.integrations.hf.trainer import PackedCP

__all__ = ["PackedCPSFTTrainer"]


class PackedCPSFTTrainer(PackedCP, SFTTrainer):
    """TRL's ``SFTTrainer`` with packed documents and contiguous CP (see the module doc)."""
