"""transformers' Trainer and TRL's SFTTrainer on packed CP equal one process
(:mod:`fcp.integrations.hf.trainer`).

The runs (``tests/_trainer_job.py``) are real launches: ``torchrun`` with 2 gloo ranks (CP 2) and
with 4 (data 2 x context 2), against transformers' own Trainer in one process on right-padded
rows of the same documents (fcp not imported) and fcp's trainer in one process (the bf16 and
SFT baselines). Four SGD steps, gradient accumulation 2, documents of 2-40 tokens (ranks hold
different numbers of loss tokens). Before the trainer, the Trainer's own token count saw each
CP group's batch once per CP rank: loss and gradients exactly 0.5x at CP 2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "_trainer_job.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, ranks: int, mode: str, *names: str) -> subprocess.Popen:
    cmd = [sys.executable, str(JOB), str(out), mode, *names]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(_port()), *cmd[1:]]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log = open(out / f"{mode}-{ranks}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer")
    jobs = [_launch(out, 1, "plain", "ref_dp1", "ref_dp2"),
            _launch(out, 1, "one", "bf16_one", "sft_one"),
            _launch(out, 2, "cp2", "fp32", "bf16", "resume", "checkpointing", "sft"),
            _launch(out, 4, "cp2", "dp2")]  # fmt: skip
    for job in jobs:
        rc = job.wait(timeout=1200)
        if rc != 0:
            logs = "\n".join(p.read_text()[-3000:] for p in out.glob("*.log"))
            pytest.fail(f"{job.args} exited {rc}:\n{logs}")
    return out


def losses(out: Path, name: str) -> list[float]:
    return json.loads((out / f"{name}.json").read_text())["losses"]


def params(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name, reference", [("fp32", "ref_dp1"), ("dp2", "ref_dp2"),
                                             ("checkpointing", "ref_dp1")])  # fmt: skip
def test_trainer_equals_one_process(runs, name, reference):
    got, want = losses(runs, name), losses(runs, reference)
    assert len(got) == len(want) == 4
    loss_err = max(abs(a - b) for a, b in zip(got, want))
    param_err = max_diff(params(runs, name), params(runs, reference))
    print(f"\n[trainer {name}] loss error {loss_err:.1e}, parameter error {param_err:.1e}")
    assert loss_err <= 1e-5 and param_err <= 1e-5
    # the evaluation loss: each CP group's token mean, averaged as the Trainer averages batches
    got_eval = json.loads((runs / f"{name}.json").read_text())["eval_loss"]
    want_eval = json.loads((runs / f"{reference}.json").read_text())["eval_loss"]
    assert abs(got_eval - want_eval) <= 1e-5


def test_bf16_autocast_is_as_accurate_as_one_process(runs):
    """accelerate's bf16 mixed precision (autocast forward, backward outside it): the CP run's
    parameters are as far from the fp32 one-process run as one bf16 process's are."""
    exact = params(runs, "ref_dp1")

    def error(name):
        got = params(runs, name)
        return sum(float((got[k] - exact[k]).pow(2).sum()) for k in exact) ** 0.5

    cp, one = error("bf16"), error("bf16_one")
    loss_cp = max(abs(a - b) for a, b in zip(losses(runs, "bf16"), losses(runs, "ref_dp1")))
    print(f"\n[trainer bf16] parameter error vs fp32: CP 2 {cp:.2e}, one process {one:.2e}; "
          f"loss error CP 2 {loss_cp:.1e}")
    assert 0 < cp <= 1.05 * one
    assert loss_cp <= 1e-3


def test_resume_from_a_checkpoint_continues_exactly(runs):
    assert losses(runs, "resume") == pytest.approx(losses(runs, "fp32"), abs=1e-6)
    assert max_diff(params(runs, "resume"), params(runs, "fp32")) <= 1e-6


def test_checkpoint_loads_strictly_into_plain_transformers(runs):
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(runs / "run_resume" / "checkpoint-2",
                                                     output_loading_info=True)  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(model) is Qwen3_5ForCausalLM  # an unmodified transformers model
    assert not any(type(m).__name__.startswith("Packed") for m in model.modules())


def test_sft_trainer_packing_equals_one_process(runs):
    """TRL's SFTTrainer(packing=True) at its default precision (bf16 autocast here) on CP 2
    against the same trainer in one process."""
    got, want = losses(runs, "sft"), losses(runs, "sft_one")
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"\n[sft] relative loss error CP 2 vs one process: {err:.1e}")
    assert len(got) == 4 and err <= 5e-5


def _trainer(tmp_path, **kw):
    from transformers import DataCollatorWithFlattening

    from fcp.integrations.hf import PackedCPTrainer
    from tests._trainer_job import BATCH, arguments, dataset, tiny_model

    overrides = {k: kw.pop(k) for k in list(kw) if k != "cp_size"}
    return PackedCPTrainer(model=tiny_model(), args=arguments(tmp_path, "v", BATCH, **overrides),
                           train_dataset=dataset(), data_collator=DataCollatorWithFlattening(),
                           **kw)  # fmt: skip


def test_arguments_that_cannot_give_the_one_process_loss_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cp_size=2 does not divide the 1 launched"):
        _trainer(tmp_path, cp_size=2)
    with pytest.raises(ValueError, match="average_tokens_across_devices=True"):
        _trainer(tmp_path, average_tokens_across_devices=False)
    with pytest.raises(ValueError, match="cp_size=0 must be >= 1"):
        _trainer(tmp_path, cp_size=0)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 is not supported"):
        _trainer(tmp_path, label_smoothing_factor=0.1)


def test_one_process_trainer_shards_and_counts(tmp_path):
    """``cp_size=1``: the batch is sharded (documents from the collator's position_ids), its
    targets counted over ``shift_labels``, and the model enabled."""
    from fcp.integrations.hf import packed_mixers

    trainer = _trainer(tmp_path, cp_size=1)
    assert packed_mixers(trainer.model)  # enable_packed_cp applied
    batch = trainer.data_collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    shards, count = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    ctx = shards[0]["cp_context"]
    assert ctx.doc_ids.tolist() == [[1, 1, 1, 2, 2]]
    assert shards[0]["shift_labels"].tolist() == [[6, 7, -100, 9, -100]]
    assert "labels" not in shards[0] and int(count) == 3
