"""transformers' GLM-5.3-Flash trained on packed documents with fcp: per-document parity.

:func:`fcp.integrations.hf.enable_packed_cp` replaces the KDA and indexed-attention modules of a
tiny random ``Glm5NextTextModel``. Every packed document must then come out exactly as
transformers computes it alone (outputs to 1e-5; every parameter's gradient, summed over the CP
ranks, to 1e-5 relative to the larger of its own largest entry and a tenth of the model's largest
gradient entry: fp32 rounding of differently ordered sums), on 1, 2 and 4 gloo ranks, for Hypothesis packings: documents shorter
than a pool and than the conv width, a document spanning every rank, padding, two rows.

The reference (transformers itself, FLA blocked, in a subprocess) is run once per session over a
pool of documents; each example packs a subset of them. Its indexer breaks ties at the top-k
boundary by the earlier pool, fcp's documented rule (see :mod:`tests.support.hf_reference`);
the number of query rows where transformers' own ``torch.topk`` chose another tied set is
reported, not exempted.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fcp
from fcp.integrations.hf import IndexedMlaMixer, KdaMixer
from tests import _hf_rank_fns as fns
from tests.support.hf_packings import document_packings
from tests.support.hf_reference import GLM5_TINY, build, per_document

FAMILY = "glm5_next"
HIDDEN = GLM5_TINY["hidden_size"]
# pool of documents: shorter than the conv width (1, 2), than a pool (3), around index_topk (8),
# and long enough for the sparse phase (up to 37 tokens, several pools)
LENGTHS = [1, 2, 3, 5, 8, 9, 13, 17, 22, 30, 37]


@pytest.fixture(scope="module")
def reference():
    pool = fns.documents(LENGTHS, HIDDEN, seed=11)
    state = {k: v.clone() for k, v in build(FAMILY, GLM5_TINY).state_dict().items()}
    ref = per_document(FAMILY, GLM5_TINY, state, pool["docs"], pool["cots"])
    print(f"\n[hf-glm5] transformers' topk chose another tied set on {ref['tie_rows']} of "
          f"{ref['indexed_rows']} indexed query rows (fcp's rule: the earlier pool)")
    return dict(state=state, **pool, **ref)


@pytest.mark.slow
@settings(deadline=None, max_examples=12)
@given(document_packings(LENGTHS))
def test_packed_documents_equal_transformers_on_each_document(rank_pool, reference, case):
    world, rows, seq = case
    fns.check(reference, rows, fns.run(rank_pool, reference, FAMILY, GLM5_TINY, world, rows, seq))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_document_spanning_every_rank_with_padding(rank_pool, reference, world):
    # 37 + 1 tokens across every rank, short docs, padding
    fns.check_spanning_every_rank(rank_pool, reference, FAMILY, GLM5_TINY, world,
                                  rows=[[10, 0], [9, 2, 4]], seq=41)  # fmt: skip


def test_without_a_context_the_original_code_runs(reference):
    assert reference["no_context_max_diff"] == 0.0


def test_replacement_keeps_parameters_and_keys():
    model = fns.check_replacement(FAMILY, GLM5_TINY, {"Glm5NextTextLinearAttention": KdaMixer,
                                                      "Glm5NextTextAttention": IndexedMlaMixer})
    kinds = [type(layer.self_attn) for layer in model.layers]
    assert [k.__name__ for k in kinds] == (["PackedGlm5NextTextLinearAttention"] * 3
                                           + ["PackedGlm5NextTextAttention"])  # fmt: skip
    assert [k.__bases__[0] for k in kinds] == [KdaMixer] * 3 + [IndexedMlaMixer]


def test_compiled_model_does_not_recompile_across_packings(reference):
    """The integrated model under torch.compile over 10 packings: one compilation; the fcp
    modules themselves trace with fullgraph=True."""
    import torch._dynamo.testing

    model = fns.packed_model(FAMILY, GLM5_TINY, reference["state"])
    gen = torch.Generator().manual_seed(3)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, dynamic=False)
    # one KDA mixer and the indexed one (the other KDA layers are the same code)
    mixers = [torch.compile(model.layers[i].self_attn, backend="aot_eager", fullgraph=True,
                            dynamic=False) for i in (0, 3)]  # fmt: skip
    for step in range(10):
        perm = torch.randperm(len(LENGTHS), generator=gen).tolist()
        rows = [perm[:3], perm[3:5]]
        batch, _ = fns.pack(reference, rows, 80)
        local, ctx = fcp.shard_batch(None, batch)
        got = compiled(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        want = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
        x = torch.randn(2, 80, HIDDEN, generator=gen)
        for mixer in mixers:
            mixer(x, cp_context=ctx)
    assert counter.frame_count == 1, counter.frame_count
