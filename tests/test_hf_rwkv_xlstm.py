"""RWKV-4 (``rwkv``) and xLSTM (``xlstm``) trained on packed documents with fcp, against
transformers run on each document alone (its PyTorch paths: ``rwkv_linear_attention_cpu``,
xLSTM's native chunkwise / per-step mLSTM kernels).

Their models pass no keyword arguments down to the blocks, so besides the token mixers
(RWKV's time mixing on :func:`fcp.ops.wkv.wkv` and channel mixing, both token-shifted; xLSTM's
mLSTM on :func:`fcp.ops.mlstm.mlstm_stabilizer` + :func:`fcp.ops.gla.gla`) their blocks and
backbones (and RWKV's causal LM) are adapted to hand the context on. The battery of
``tests/test_hf_families.py``: outputs to 1e-5 and rank-summed parameter gradients to 1e-5 on
1, 2 and 4 gloo ranks over Hypothesis packings (documents shorter than a chunk, one spanning
every rank, padding, two rows); the original code without a context; the replacement contract;
the causal LM wrappers; one compiled graph per mixer kind over packings.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fcp
from fcp.integrations.hf import enable_packed_cp
from fcp.integrations.hf.families import family
from tests import _hf_rank_fns as fns
from tests.support.hf_families import HIDDEN, LENGTHS, SEED, documents, packings
from tests.support.hf_reference import build

NAMES = ["rwkv", "xlstm"]
#: the registry rows' tiny configurations (plain dicts, as the reference subprocess pickles them)
CONFIGS = {name: dict(family(name).test_config) for name in NAMES}


@pytest.fixture(scope="module")
def references():
    return fns.references(CONFIGS, LENGTHS, HIDDEN, seed=SEED)


@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_equal_transformers_on_each_document(rank_pool, references, name):
    reference, config = references[name], CONFIGS[name]

    @settings(deadline=None, max_examples=2)
    @given(case=packings)
    def packed_equals_each_document(case):
        world, rows, seq = case
        fns.check(reference, rows, fns.run(rank_pool, reference, name, config, world, rows, seq))

    packed_equals_each_document()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_one_document_spanning_every_rank_with_padding(rank_pool, references, name, world):
    fns.check_spanning_every_rank(rank_pool, references[name], name, CONFIGS[name], world)


@pytest.mark.parametrize("name", NAMES)
def test_without_a_context_the_original_code_runs(references, name):
    assert references[name]["no_context_max_diff"] == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_replacement_keeps_the_state_dict_and_loads_it_strictly(name):
    mixers = {cls: mixer for cls, mixer in family(name).mixers.items()
              if cls != "RwkvForCausalLM"}  # the backbone holds no causal LM  # fmt: skip
    fns.check_replacement(name, CONFIGS[name], mixers)


@pytest.mark.parametrize("name, causal_lm, backbone, head",
                         [("rwkv", "RwkvForCausalLM", "rwkv", "head"),
                          ("xlstm", "xLSTMForCausalLM", "backbone", "lm_head")])  # fmt: skip
def test_causal_lm_wrapper(name, causal_lm, backbone, head):
    """The ``*ForCausalLM``'s logits are the packed backbone's outputs through its head (xLSTM
    soft-caps them), and ``shift_labels`` give transformers' loss on each document."""
    import transformers

    packed = enable_packed_cp(build(name, CONFIGS[name]))
    lm = getattr(transformers, causal_lm)(packed.config).eval()
    getattr(lm, backbone).load_state_dict(packed.state_dict())
    enable_packed_cp(lm)
    batch, _ = fns.pack(documents(), [[5, 1, 3]], 30)
    local, ctx = fcp.shard_batch(None, dict(batch, labels=batch["input_ids"]))
    with torch.no_grad():
        out = lm(input_ids=local["input_ids"], shift_labels=local["shift_labels"], cp_context=ctx)
        hidden = packed(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
    logits = getattr(lm, head)(hidden)
    cap = getattr(lm.config, "output_logit_soft_cap", None) if name == "xlstm" else None
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    torch.testing.assert_close(out.logits, logits.to(out.logits.dtype))
    targets = local["shift_labels"]
    want = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(),
                                             ignore_index=-100)  # fmt: skip
    torch.testing.assert_close(out.loss, want)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_mixers_do_not_recompile_across_packings(name):
    """The token mixers compiled as the demo does (``mixer.compile``, fullgraph, aot_eager),
    the model run over 4 packings of one shape: one graph per mixer kind, made at the first
    step, and the compiled model's outputs equal eager's (the block and backbone adapters only
    hand the context on and stay eager)."""
    import torch._dynamo.testing

    from fcp.integrations.hf.mixers import STEPS
    from tests.test_hf_core import packed_batch

    model, eager = (enable_packed_cp(build(name, CONFIGS[name])) for _ in range(2))
    kinds = tuple(STEPS)
    mixers = [m for m in model.modules() if isinstance(m, kinds)]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for mixer in mixers:
        mixer.compile(backend=counter, fullgraph=True, dynamic=False)
    counts = []
    with torch.no_grad():
        for step in range(4):
            local, ctx = packed_batch(20 + step)
            got, want = (m(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
                         for m in (model, eager))  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            counts.append(counter.frame_count)
    n_kinds = len({type(m) for m in mixers})
    assert counts == [n_kinds] * 4, counts
