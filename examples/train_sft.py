"""TRL's SFTTrainer with packing on dp 2 x cp 2 gloo ranks, next to the same run in one process.

    python examples/train_sft.py              # starts the 4 ranks and the one-process run itself
    python examples/train_sft.py --dp 1 --cp 2 --steps 4

A tiny random Qwen3.5 (``Qwen3_5ForCausalLM``: Gated DeltaNet and gated attention layers) learns
the opening lines of Python's standard library files, character by character
(:mod:`examples.byte_tokenizer`), with ``SFTConfig(packing=True)``: TRL packs the documents into
rows, and :class:`fcp.integrations.hf.PackedCPSFTTrainer` shards each row over the CP ranks.
The lines a user's SFTTrainer script changes::

    from fcp.integrations.hf import PackedCPSFTTrainer            # instead of SFTTrainer
    trainer = PackedCPSFTTrainer(model=model, args=SFTConfig(packing=True, ...),
                                 train_dataset=ds, processing_class=tok, cp_size=2)

The reference is the same trainer in one process with ``dp x`` the batch (the same documents
per step; fcp in one process computes each packed document as transformers computes it alone,
``tests/test_hf_families.py``). The run prints both loss curves and ends with
``max relative difference vs one process: <number>``. TRL's default precision applies (bf16
autocast where the machine has it), so the two runs differ by bf16 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def documents(count: int, max_chars: int = 240) -> list[str]:
    """The opening ``max_chars`` characters of ``count`` standard-library files."""
    from examples.data import stdlib_source_files

    out = []
    for path in stdlib_source_files():
        text = path.read_text(errors="replace")[:max_chars].strip()
        if len(text) > 16 and text.isascii():
            out.append(text)
        if len(out) == count:
            break
    return out


def worker(args) -> None:
    from datasets import Dataset
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from trl import SFTConfig

    from examples.byte_tokenizer import byte_tokenizer
    from fcp.integrations.hf import PackedCPSFTTrainer

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, layer_types=["linear_attention",
                                                                 "full_attention"],
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, pad_token_id=0,
                               eos_token_id=1)  # fmt: skip
    model = Qwen3_5ForCausalLM(config)
    data = Dataset.from_dict({"text": documents(args.docs)})
    sft = SFTConfig(output_dir=str(Path(args.out) / "run"), packing=True, max_length=512,
                    per_device_train_batch_size=args.batch * (args.dp if args.one else 1),
                    max_steps=args.steps, learning_rate=3e-3, logging_steps=1, seed=0,
                    save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = PackedCPSFTTrainer(model=model, args=sft, train_dataset=data,
                                 processing_class=byte_tokenizer(),
                                 cp_size=1 if args.one else args.cp)  # fmt: skip
    trainer.train()
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        name = "one.json" if args.one else "cp.json"
        (Path(args.out) / name).write_text(json.dumps(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="documents per rank per step")
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out is not None:  # a rank (under torchrun) or the one-process run
        return worker(args)

    out = tempfile.mkdtemp(prefix="fcp_sft_")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    common = [str(Path(__file__).resolve()), "--out", out, "--dp", str(args.dp), "--cp",
              str(args.cp), "--steps", str(args.steps), "--batch", str(args.batch), "--docs",
              str(args.docs)]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"training on {args.dp} x {args.cp} gloo ranks, then in one process ...", flush=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(args.dp * args.cp), "--master-addr", "127.0.0.1", "--master-port",
                    str(port), *common], env=env, check=True)  # fmt: skip
    subprocess.run([sys.executable, *common, "--one"], env=env, check=True)
    cp = json.loads((Path(out) / "cp.json").read_text())
    one = json.loads((Path(out) / "one.json").read_text())
    print(f"\n{'step':>4}  {'dp x cp loss':>12}  {'one process':>12}  {'rel. diff':>9}")
    for step, (a, b) in enumerate(zip(cp, one), 1):
        print(f"{step:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b) / abs(b):>9.1e}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(cp, one))
    print(f"max relative difference vs one process: {worst:.1e}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
