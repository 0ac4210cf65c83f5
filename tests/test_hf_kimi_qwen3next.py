"""transformers' Kimi-Linear and Qwen3-Next on fcp: what the standard battery does not cover.

Their per-document parity, replacement contract and ``*ForCausalLM`` wrappers are in
``tests/test_hf_families.py``. Here: Qwen3-Next's attention enabled on its own takes its RoPE
positions from the context, and both whole models (not only their mixers) compile once across
packings.
"""

from __future__ import annotations

import pytest
import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_checks import check_attention_alone
from tests.support.hf_families import FAMILIES, LENGTHS, documents
from tests.support.hf_reference import QWEN3_NEXT_TINY, build


def test_attention_alone_takes_its_positions_from_the_context():
    """Qwen3-Next's attention enabled on its own (no enclosing model, no rotary module): on packed
    documents it equals transformers' code on each document alone, given the model's rotary
    tables at positions ``0 .. n-1``: RoPE comes from the layer's config at document-local
    positions."""
    model = build("qwen3_next", QWEN3_NEXT_TINY)
    check_attention_alone(enable_packed_cp(model.layers[1].self_attn), model.rotary_emb)


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next"])
def test_compiled_model_does_not_recompile_across_packings(family):
    """The whole integrated model (its two mixer kinds: a 2-layer variant of the tiny config)
    compiles with ``fullgraph=True`` (aot_eager, forward and backward graphs) once, and the
    compiled model equals eager over 4 packings without recompiling."""
    import torch._dynamo.testing

    two = {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2}
    if family == "kimi_linear":
        two["mlp_layer_types"] = ["dense", "sparse"]
    model = enable_packed_cp(build(family, dict(FAMILIES[family].config, **two)))
    pool = documents()
    gen = torch.Generator().manual_seed(3)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    for _ in range(4):
        perm = torch.randperm(len(LENGTHS), generator=gen).tolist()
        batch, _ = fns.pack(pool, [perm[:3], perm[3:5]], 80)
        local, ctx = fcp.shard_batch(None, batch)
        got = compiled(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        want = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
    assert counter.frame_count == 1, counter.frame_count
