"""The loss of an enabled transformers causal LM under a ``cp_context``
(:mod:`fcp.integrations.hf.causal_lm`): the one-process loss from ``shift_labels``, or an error.

The oracle is transformers' own ``Qwen3_5ForCausalLM`` run on each document alone with
``labels=`` (its head shifts them): the loss of the packed batch is the token mean over all
documents' targets. Before this, ``labels=`` under a ``cp_context`` was shifted inside each
shard (a target lost at every shard boundary, ranks weighted by their own counts: 1.8e-3 off).
"""

from __future__ import annotations

import pytest
import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests._causal_lm_rank_fns import causal_lm, loss_and_grads

LENGTHS = (7, 1, 12, 5)  # a one-token document has no target


def packed_batch() -> tuple[dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 128, (n,), generator=gen) for n in LENGTHS]
    ids = torch.cat(docs)[None]
    return {"input_ids": ids, "labels": ids.clone(), "seq_lens": torch.tensor([LENGTHS])}, docs


def per_document_reference() -> tuple[float, dict, int]:
    """transformers alone on each document: ``(token-mean loss, its gradients, targets)``."""
    model = causal_lm()
    _, docs = packed_batch()
    targets = sum(len(d) - 1 for d in docs)
    total = 0.0
    for d in docs:
        if len(d) < 2:
            continue
        out = model(input_ids=d[None], labels=d[None])
        (out.loss * (len(d) - 1) / targets).backward()
        total += float(out.loss.detach()) * (len(d) - 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total / targets, grads, targets


@pytest.fixture(scope="module")
def reference():
    return per_document_reference()


def assert_grads_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    scale = max(float(g.abs().max()) for g in want.values())
    assert got.keys() == want.keys()
    for name, g in got.items():
        err = float((g - want[name]).abs().max()) / max(float(want[name].abs().max()), 0.1 * scale)
        assert err <= tol, (name, err)


def test_one_process_loss_is_the_per_document_mean(reference):
    loss, grads, _ = reference
    got, got_grads = loss_and_grads(None, packed_batch()[0])
    assert abs(got - loss) <= 1e-6 * abs(loss)
    assert_grads_close(got_grads, grads)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_loss_equals_one_process_on_every_rank(rank_pool, reference, world):
    """Every rank reports the one-process loss; the ranks' gradients averaged (DDP, FSDP2) are
    the one-process gradients, with a document split at every shard boundary."""
    loss, grads, _ = reference
    results = rank_pool.run(loss_and_grads, world, packed_batch()[0], timeout=120)
    for got, _ in results:
        assert abs(got - loss) <= 1e-6 * abs(loss)
    mean = {n: sum(r[1][n] for r in results) / world for n in grads}
    assert_grads_close(mean, grads)


def test_num_items_in_batch_is_transformers_contract(rank_pool, reference):
    """With ``num_items_in_batch`` (the Trainer's global count), each rank's loss is its own
    token-loss sum over it: the ranks' losses and gradients sum to the one-process ones."""
    loss, grads, targets = reference
    results = rank_pool.run(loss_and_grads, 2, packed_batch()[0], targets, timeout=120)
    assert abs(sum(r[0] for r in results) - loss) <= 1e-6 * abs(loss)
    assert all(abs(r[0] - loss) > 1e-3 for r in results)  # each rank's share, not the mean
    assert_grads_close({n: sum(r[1][n] for r in results) for n in grads}, grads)


def test_labels_alone_under_a_context_raise():
    model = enable_packed_cp(causal_lm())
    batch, _ = packed_batch()
    local, ctx = fcp.shard_batch(None, batch)
    with pytest.raises(ValueError, match="shift_labels"):
        model(input_ids=local["input_ids"], labels=batch["labels"], cp_context=ctx)


def test_shift_labels_must_match_the_logits():
    model = enable_packed_cp(causal_lm())
    local, ctx = fcp.shard_batch(None, packed_batch()[0])
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(**local, cp_context=ctx, logits_to_keep=1)


def test_without_a_context_transformers_computes_its_own_loss():
    model = causal_lm()
    ids = packed_batch()[1][0][None]
    want = float(model(input_ids=ids, labels=ids).loss)
    assert float(enable_packed_cp(model)(input_ids=ids, labels=ids).loss) == want
