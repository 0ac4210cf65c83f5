"""Data x context parallel training with FSDP2 on a (2, 2) gloo mesh equals one process.

The global batch's rows are dealt to the two data-parallel replicas; each replica's rows are
sharded contiguously over its two CP ranks; FSDP2 shards the parameters over the flattened
(dp, cp) mesh; every rank's loss is its token-loss sum over the global number of loss tokens
(:func:`fcp.loss.global_token_mean`). Three AdamW steps must equal single-process training on the
whole global batch (losses and final parameters, fp32, 1e-5 relative; see the test for the
scale of tiny-valued tensors). The packings give every
row and rank a different number of loss tokens, and one rank holds only padding.
"""

from __future__ import annotations

import pytest
import torch

from fcp.layout import doc_ids_from_seq_lens
from fcp.loss import global_token_mean, loss_token_count
from tests import _fsdp_rank_fns as fns

SEQ = 32
POOL_TIMEOUT_S = 300


def make_batches(steps: int = 3) -> list[dict]:
    """Global batches of 4 rows x 32 tokens: rows 0/2 go to dp replica 0, rows 1/3 to replica 1.
    Rows 1 and 3 hold 12 tokens of documents, then padding: replica 1's second CP rank (tokens
    16..31) holds only padding."""
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(steps):
        lens = torch.tensor([[9, 11, 12, -1000], [5, 7, -1000, -1000],
                             [3, 1, 20, -1000], [12, -1000, -1000, -1000]])  # fmt: skip
        doc_ids = doc_ids_from_seq_lens(lens, SEQ)
        ids = torch.randint(1, 256, (4, SEQ), generator=gen)
        targets = torch.where(doc_ids > 0, torch.roll(ids, -1, 1), -100)  # aligned: next token
        targets[:, -1] = -100
        ids = torch.where(doc_ids > 0, ids, 0)
        batches.append({"input_ids": ids, "shift_labels": targets, "seq_lens": lens})
    return batches


def example_model():
    from examples.models import build_model

    return build_model("qwen3", layers=("kda", "compressed"), d_model=32)


def glm5_hf_model():
    """transformers' GLM-5.3-Flash on fcp (the demo's model), smaller."""
    from examples.glm5_hf import Glm5NextLM

    return Glm5NextLM.from_config(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                  kv_lora_rank=16, q_lora_rank=16, index_topk=8)  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_packings_hold_different_token_counts_and_a_padding_only_rank():
    batch = make_batches(1)[0]
    counts = (batch["shift_labels"] != -100).view(4, 2, SEQ // 2).sum(-1)  # [row, cp rank]
    assert len(set(counts.flatten().tolist())) > 4
    # dp replica 1 holds rows 1 and 3; its CP rank 1 holds tokens 16..31 of both: no labels
    assert counts[1, 1] == 0 and counts[3, 1] == 0


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["example", "glm5-hf"])
def test_three_adamw_steps_equal_single_process(rank_pool, model_name):
    model_fn = {"example": example_model, "glm5-hf": glm5_hf_model}[model_name]
    batches = make_batches(3)
    ref_losses, ref_params = fns.single_process_train(model_fn, batches, lr=1e-3)
    results = rank_pool.run(fns.fsdp_train, 4, model_fn, batches, 2, 2, 1e-3,
                            timeout=POOL_TIMEOUT_S)  # fmt: skip
    for losses, params in results:
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
        assert params.keys() == ref_params.keys()
        # 1e-5 relative to the tensor's largest entry, or to a tenth of the model's largest
        # parameter for tensors of tiny values (a zero-initialised mHC bias 3 Adam steps in:
        # Adam normalises its ~1e-7 gradients, so their float32 rounding moves it by ~1e-3
        # of its size; measured: 3e-5 of itself, 7e-7 of the model scale)
        scale = max(float(p.abs().max()) for p in ref_params.values())
        for name, p in params.items():
            want = ref_params[name]
            den = max(float(want.abs().max()), 0.1 * scale)
            assert float((p - want).abs().max()) / den <= 1e-5, name


@pytest.mark.slow
def test_checkpoint_resume_gives_the_uninterrupted_losses(rank_pool, tmp_path):
    batches = make_batches(3)
    plain = rank_pool.run(fns.fsdp_train, 4, example_model, batches, 2, 2, 1e-3,
                          timeout=POOL_TIMEOUT_S)  # fmt: skip
    resumed = rank_pool.run(fns.fsdp_train, 4, example_model, batches, 2, 2, 1e-3,
                            (str(tmp_path / "ckpt"), 0), timeout=POOL_TIMEOUT_S)  # fmt: skip
    for (l_plain, p_plain), (l_res, p_res) in zip(plain, resumed):
        assert l_res == l_plain  # bitwise: same data, same state, same arithmetic
        for name in p_plain:
            assert torch.equal(p_res[name], p_plain[name]), name
    assert any(p.stat().st_size for p in (tmp_path / "ckpt").iterdir())


def test_global_token_mean_single_process_is_the_plain_mean():
    loss_sum = torch.tensor(6.0, requires_grad=True)
    out = global_token_mean(loss_sum, torch.tensor(4), None)
    assert float(out.value) == 1.5 and float(out.tokens) == 4
    out.objective.backward()
    assert float(loss_sum.grad) == 0.25
    empty = global_token_mean(torch.tensor(0.0), 0, None, gradient_divide_factor=3)
    assert float(empty.value) == 0.0 and float(empty.objective) == 0.0  # no NaN for no tokens
    with pytest.raises(ValueError, match="gradient_divide_factor"):
        global_token_mean(loss_sum, 4, None, gradient_divide_factor=0)
    assert int(loss_token_count(torch.tensor([[1, -100, 3]]))) == 2


def test_global_token_mean_over_ranks(rank_pool):
    results = rank_pool.run(fns.global_mean_on_ranks, 3)
    for value, tokens, grad in results:
        assert value == pytest.approx(6.0 / 7.0) and tokens == 7.0
    # ranks hold 1, 2, 4 tokens with loss sums 0, 2, 4; gradient factor 3 (an averaging reduce)
    assert [r[2] for r in results] == pytest.approx([3 / 7] * 3)

