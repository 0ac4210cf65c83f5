"""Trainer runs for ``tests/test_trainer.py``: one process per rank under ``torchrun``, or one
process alone for the references. Each run writes ``<out>/<name>.json`` (per-step losses, rank 0)
and ``<out>/<name>.pt`` (final parameters, rank 0).

    torchrun --nproc-per-node 2 tests/_trainer_job.py OUT cp2 fp32 bf16 resume sft
    torchrun --nproc-per-node 4 tests/_trainer_job.py OUT cp2 dp2           # dp 2 x cp 2
    python tests/_trainer_job.py OUT plain ref_dp1 ref_dp2      # transformers alone, no fcp
    python tests/_trainer_job.py OUT one bf16_one sft_one        # fcp in one process

The data: 32 documents of 2-40 random tokens; every step takes ``GA x batch`` of them on each
data-parallel rank, so ranks hold different numbers of loss tokens. The one-process reference
(``plain``) is transformers' own Trainer on right-padded rows of the same documents (its
padding-masked Gated DeltaNet and attention compute each row as the document alone), with
``dp x batch`` documents per micro-batch: the union of the data-parallel ranks' micro-batches
(accelerate gives rank ``i`` the sampler's batches ``i, i + dp, ...``).

The optimizer is plain SGD: Adam divides each gradient by its own running scale, so it hides a
wrong loss normalisation (the Trainer's 0.5x at CP 2 trains the same parameters) and turns the
fp32 rounding noise of gradients that are zero in exact arithmetic (1e-12 against 0.2 for the
first Gated DeltaNet layer's decay parameters here) into steps of the learning rate's size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

STEPS, GA, BATCH, DOCS = 4, 2, 2, 32


def documents() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 41, (DOCS,), generator=g)
    return [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in lengths]


def tiny_model():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.support.hf_reference import QWEN3_5_TINY

    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_TINY)).float()


def arguments(out: Path, name: str, batch: int, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=str(out / f"run_{name}"), per_device_train_batch_size=batch,
              gradient_accumulation_steps=GA, max_steps=STEPS, learning_rate=0.3, optim="sgd",
              logging_steps=1, save_strategy="no", per_device_eval_batch_size=BATCH, report_to=[], use_cpu=True, seed=11,
              data_seed=11, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
              lr_scheduler_type="constant", warmup_steps=0)  # fmt: skip
    kw.update(overrides)
    return TrainingArguments(**kw)


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": documents()})


def pad_collator(features):
    """Right-padded rows, labels -100 on the padding: transformers' plain causal-LM batch."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    mask = torch.zeros(len(features), n, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def save(trainer, out: Path, name: str, evaluate: bool = True) -> None:
    """After training: the losses, the evaluation loss over all documents, the parameters."""
    eval_loss = trainer.evaluate(eval_dataset=dataset())["eval_loss"] if evaluate else None
    if trainer.args.process_index != 0:
        return
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (out / f"{name}.json").write_text(json.dumps({"losses": losses, "eval_loss": eval_loss}))
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.save({k: v.detach().float().clone() for k, v in model.state_dict().items()},
               out / f"{name}.pt")  # fmt: skip


def run_plain(out: Path, name: str) -> None:
    """transformers alone (no fcp imported): the one-process fp32 reference."""
    from transformers import Trainer

    dp = {"ref_dp1": 1, "ref_dp2": 2}[name]
    trainer = Trainer(model=tiny_model(), args=arguments(out, name, BATCH * dp),
                      train_dataset=dataset(), data_collator=pad_collator)  # fmt: skip
    trainer.train()
    save(trainer, out, name)


def run_fcp(out: Path, name: str, cp_size: int) -> None:
    from transformers import DataCollatorWithFlattening

    from fcp.integrations.hf import PackedCPTrainer

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    bf16 = name.startswith("bf16")
    extra = {"gradient_checkpointing": True} if name == "checkpointing" else {}
    if name.startswith("sft"):
        return run_sft(out, name, cp_size)
    if name == "resume":
        args = arguments(out, "resume", BATCH, save_strategy="steps", save_steps=2)
        first = PackedCPTrainer(model=tiny_model(), args=args, train_dataset=dataset(),
                                data_collator=collator, cp_size=cp_size)  # fmt: skip
        first.train()
        args = arguments(out, "resume", BATCH)
        trainer = PackedCPTrainer(model=tiny_model(), args=args, train_dataset=dataset(),
                                  data_collator=collator, cp_size=cp_size)  # fmt: skip
        trainer.train(resume_from_checkpoint=str(out / "run_resume" / "checkpoint-2"))
        save(trainer, out, name)
        return
    trainer = PackedCPTrainer(model=tiny_model(), args=arguments(out, name, BATCH, bf16=bf16, **extra),
                              train_dataset=dataset(), data_collator=collator,
                              cp_size=cp_size)  # fmt: skip
    trainer.train()
    save(trainer, out, name)


def run_sft(out: Path, name: str, cp_size: int) -> None:
    from trl import SFTConfig

    from examples.byte_tokenizer import byte_tokenizer
    from fcp.integrations.hf import PackedCPSFTTrainer

    kw = {k: v for k, v in vars(arguments(out, name, BATCH)).items()
          if k in ("output_dir", "per_device_train_batch_size", "gradient_accumulation_steps",
                   "max_steps", "learning_rate", "optim", "logging_steps", "seed", "data_seed",
                   "lr_scheduler_type")}  # fmt: skip
    # TRL's default precision (bf16 where the machine has it), packing on
    args = SFTConfig(**kw, packing=True, max_length=64, save_strategy="no", report_to=[],
                     use_cpu=True, disable_tqdm=True, dataset_num_proc=None)  # fmt: skip
    trainer = PackedCPSFTTrainer(model=tiny_model(), args=args, train_dataset=dataset(),
                                 processing_class=byte_tokenizer(), cp_size=cp_size)  # fmt: skip
    trainer.train()
    save(trainer, out, name, evaluate=False)


def main() -> None:
    out, mode, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    if mode == "plain":
        sys.modules["fla"] = None  # transformers' pure-PyTorch layers (FLA's kernels need a GPU)
        for name in names:
            run_plain(out, name)
        return
    cp_size = 1 if mode == "one" else int(mode.removeprefix("cp"))  # "cp2": CP 2 (x dp)
    for name in names:
        run_fcp(out, name, cp_size)
    import torch.distributed as dist

    if dist.is_initialized():
        # shut gloo down before the interpreter does: left to exit, a rank's process group can
        # destroy a joinable thread ("terminate called without an active exception", exit -6)
        # after every result is written, failing the launch
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
