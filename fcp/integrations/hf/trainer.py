"""transformers' ``Trainer`` on packed documents with contiguous CP: :class:`PackedCPTrainer`.

A standard Trainer script changes in three places::

    from fcp.integrations.hf import PackedCPTrainer          # 1. instead of Trainer
    trainer = PackedCPTrainer(model=model, args=args, train_dataset=ds,
                              data_collator=DataCollatorWithFlattening(),   # 2. packed rows
                              cp_size=2)                                    # 3. the CP size
    trainer.train()          # torchrun / accelerate launch --nproc-per-node 4: dp 2 x cp 2

(TRL: :class:`fcp.integrations.hf.sft.PackedCPSFTTrainer`, the same for ``SFTTrainer``.)

What the trainer does for the user, and why each piece is needed for the one-process loss:

* **Mesh.** The launched world of ``W`` processes becomes a ``(dp, cp)`` device mesh
  (``dp = W / cp_size``; the ``cp`` axis is the inner one, so a CP group is ``cp_size``
  consecutive ranks, inside a host).
* **The same batch on every CP rank.** accelerate shards the training batches over all ``W``
  processes; the trainer re-shards them over the ``dp`` ranks only, so the CP ranks of a group
  read the same batches (:func:`fcp.shard_batch` checks it on every batch).
* **Sharding.** Every batch is sharded with :func:`fcp.shard_batch` before the step: the
  documents come from the collator's packing keys (``position_ids``, ``cu_seq_lens_q``,
  ``seq_idx``, ...), the next-token targets are made over the whole row (``shift_labels``), and
  the local batch carries ``cp_context``. :func:`~fcp.integrations.hf.enable_packed_cp` is
  applied to the model.
* **Loss normalisation.** ``num_items_in_batch`` is the number of loss tokens of all
  data-parallel ranks, counted once: each rank counts its own shard's ``shift_labels`` and the
  Trainer sums over the ``W`` processes (the Trainer's own count would see each CP group's batch
  ``cp_size`` times: 0.5x the loss and gradients at CP 2). The model's loss is this rank's
  token-loss sum over it (:mod:`.causal_lm`), the Trainer multiplies by ``W`` and DDP / FSDP
  average over ``W``: the gradient of the global token mean, exactly, with gradient
  accumulation, gradient checkpointing, fp32 or bf16 autocast.

**Compilation.** ``TrainingArguments(torch_compile=True)`` (or a ``torch_compile_backend`` /
``torch_compile_mode``) compiles each decoder layer on its own
(:func:`~fcp.integrations.hf.compile_layers`: one graph per layer kind, so the compile time
grows with the kinds of layers, not the depth) instead of accelerate's whole-model
``torch.compile``; ``regional_compile=False`` restores the latter.

Evaluation computes the loss only (``prediction_loss_only``): each CP group's token mean.
Checkpoints are ordinary transformers checkpoints (fcp changes no parameter name): they load
into an unmodified model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import Trainer

from fcp.checks import check_instance, check_positive_int
from fcp.integrations.hf import compile_layers, enable_packed_cp
from fcp.shard import IGNORE_INDEX, shard_batch

__all__ = ["PackedCP", "PackedCPTrainer"]


class PackedCP:
    """The CP behaviour, mixed in before a ``Trainer`` class (``PackedCPTrainer``,
    ``PackedCPSFTTrainer``).

    Args (keyword only, besides the trainer's own):
        cp_size: CP ranks per group; must divide the number of launched processes.
        shard_options: further keyword arguments of :func:`fcp.shard_batch` (``pad_multiple``,
            ``pad_to``, ``padding_token_id``, ...).
        allow_unreplaced: handed to :func:`~fcp.integrations.hf.enable_packed_cp`.
        regional_compile: with ``TrainingArguments(torch_compile=True)``, compile the decoder
            layers one by one (:func:`~fcp.integrations.hf.compile_layers`, the default) rather
            than the whole model (accelerate's ``torch.compile``).
        compile_options: further keyword arguments of ``torch.compile`` for the layers
            (``fullgraph``, ``dynamic``, ``options``); the backend and mode are the
            ``TrainingArguments``' ``torch_compile_backend`` / ``torch_compile_mode``. Refused
            (``ValueError``) where no layer is compiled.
    """

    def __init__(self, *args, cp_size: int = 1, shard_options: dict | None = None,
                 allow_unreplaced: bool = False, regional_compile: bool = True,
                 compile_options: dict | None = None, **kwargs) -> None:  # fmt: skip
        name = type(self).__name__
        self.fcp_cp_size = check_positive_int(cp_size, "cp_size", fn=name)
        self.fcp_shard_options = dict(check_instance(shard_options or {}, dict, "shard_options",
                                                     fn=name))  # fmt: skip
        self.fcp_regional_compile = check_instance(regional_compile, bool, "regional_compile",
                                                   fn=name)  # fmt: skip
        self.fcp_compile_options = dict(check_instance(compile_options or {}, dict,
                                                       "compile_options", fn=name))  # fmt: skip
        for key in ("backend", "mode"):
            if key in self.fcp_compile_options:
                raise ValueError(f"{name}: compile_options={{{key!r}: ...}}: give it as "
                                 f"TrainingArguments(torch_compile_{key}=...)")  # fmt: skip
        super().__init__(*args, **kwargs)
        args_ = self.args
        if self.fcp_compile_options and not self._fcp_compiles_layers():
            raise ValueError(
                f"{name}: compile_options={self.fcp_compile_options!r} would go unused: they "
                "apply to the decoder layers' compile, which needs TrainingArguments("
                f"torch_compile=True) and regional_compile=True (got torch_compile="
                f"{args_.torch_compile}, regional_compile={self.fcp_regional_compile})"
            )
        world = self.accelerator.num_processes
        if world % self.fcp_cp_size:
            raise ValueError(f"{name}: cp_size={cp_size} does not divide the {world} launched "
                             "processes (the world is dp x cp)")  # fmt: skip
        if not args_.average_tokens_across_devices:
            raise ValueError(
                f"{name}: TrainingArguments(average_tokens_across_devices=False) normalises each "
                "rank's loss by its own shard's tokens, which is not the one-process loss under "
                "CP; set average_tokens_across_devices=True"
            )
        if args_.label_smoothing_factor or self.compute_loss_func is not None:
            what = (f"label_smoothing_factor={args_.label_smoothing_factor}"
                    if args_.label_smoothing_factor else "compute_loss_func")  # fmt: skip
            raise ValueError(
                f"{name}: {what} is not supported: under CP the loss comes from the model's "
                "shift_labels (fcp.integrations.hf.causal_lm), and the Trainer would hand these "
                "no labels (the local batch carries none); drop it"
            )
        if args_.n_gpu > 1:
            raise ValueError(f"{name}: one process per device (launch with torchrun or accelerate "
                             f"launch); got n_gpu={args_.n_gpu} (torch DataParallel)")  # fmt: skip
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and getattr(pc, "cp_size", 1) > 1:
            raise ValueError(
                f"{name}: accelerate's ParallelismConfig(cp_size={pc.cp_size}) runs its own "
                "SDPA context parallelism; pass cp_size to the trainer instead"
            )
        self.fcp_dp_size = world // self.fcp_cp_size
        self.fcp_dp_rank, self.fcp_cp_group = 0, None
        if world > 1:
            mesh = init_device_mesh(args_.device.type, (self.fcp_dp_size, self.fcp_cp_size),
                                    mesh_dim_names=("dp", "cp"))  # fmt: skip
            self.fcp_dp_rank = mesh.get_local_rank("dp")
            self.fcp_cp_group = mesh["cp"] if self.fcp_cp_size > 1 else None
        model = enable_packed_cp(self.accelerator.unwrap_model(self.model),
                                 allow_unreplaced=allow_unreplaced)
        if self._fcp_compiles_layers():
            compile_layers(model, backend=args_.torch_compile_backend,
                           mode=args_.torch_compile_mode, **self.fcp_compile_options)
        # fcp's loss hook takes num_items_in_batch whatever the model's forward signature
        self.model_accepts_loss_kwargs = True

    def _fcp_compiles_layers(self) -> bool:
        return bool(self.args.torch_compile) and self.fcp_regional_compile

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        if self._fcp_compiles_layers():
            # the layers are compiled in __init__; accelerate would compile the whole model
            # around them (prepare(): torch.compile unless the backend is "no")
            from accelerate.utils import TorchDynamoPlugin

            args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return args

    # -- data: the same batches on the CP ranks of a group, sharded before the step -------------

    def get_train_dataloader(self):
        return self._split_over_dp(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._split_over_dp(super().get_eval_dataloader(eval_dataset))

    def _split_over_dp(self, loader):
        from accelerate.data_loader import BatchSamplerShard

        sampler = getattr(loader, "batch_sampler", None)
        if isinstance(sampler, BatchSamplerShard):
            sampler.num_processes = self.fcp_dp_size
            sampler.process_index = self.fcp_dp_rank
        elif self.accelerator.num_processes > 1:
            raise ValueError(
                f"{type(self).__name__}: the dataloader is not sharded by batches "
                f"({type(sampler).__name__}); every CP rank of a group must read the same "
                "batches: give a map-style dataset (with __len__) and dispatch_batches=False"
            )
        return loader

    def fcp_shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` (a collator's full rows) sharded for this CP rank, with ``cp_context``."""
        local, ctx = shard_batch(self.fcp_cp_group, batch, **self.fcp_shard_options)
        if "shift_labels" not in local:
            raise ValueError(f"{type(self).__name__}: the batch has neither labels nor "
                             f"shift_labels (keys: {sorted(batch)})")  # fmt: skip
        local["cp_context"] = ctx
        return local

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        shards = []
        for _ in range(num_batches):
            try:
                shards.append(self.fcp_shard(next(epoch_iterator)))
            except StopIteration:
                break
        if not shards:
            return shards, None
        # every rank counts its own shard once, so the sum over all processes counts each data-
        # parallel batch once (the Trainer's count would see a CP group's batch cp_size times)
        count = sum(s["shift_labels"].ne(IGNORE_INDEX).sum() for s in shards).to(device)
        if self.accelerator.num_processes > 1:
            count = self.accelerator.gather(count).sum()
        return shards, count

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not prediction_loss_only:
            raise NotImplementedError(
                f"{type(self).__name__} evaluates the loss only; logits and labels under CP are "
                "sharded (set prediction_loss_only=True and no compute_metrics)"
            )
        local = self._prepare_inputs(self.fcp_shard(inputs))
        with torch.no_grad():
            loss = model(**local).loss  # the CP group's token mean (causal_lm)
        return loss.detach(), None, None


class PackedCPTrainer(PackedCP, Trainer):
    """transformers' ``Trainer`` with packed documents and contiguous CP (see the module doc)."""
