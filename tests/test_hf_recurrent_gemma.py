"""RecurrentGemma's recurrent block on fcp (:class:`~fcp.integrations.hf.mixers.rglru.RglruMixer`)
against transformers' own ``RecurrentGemmaRecurrentBlock`` run on each document alone, in this
process, with decays from none to strong: ``softplus(recurrent_param)`` from 1e-8 (``a`` rounds
to 1 in fp32, so ``1 - a^2`` is 0 or one ulp and transformers' clipped ``sqrt`` derivative is
what the gradient sees) to 5 (``log a`` down to -40). Outputs, input gradients and parameter
gradients (summed over the documents) to 1e-5 relative. The whole model (local attention
beside it, CP on 1, 2 and 4 ranks, compile) is in the standard battery
(``tests/test_hf_families.py``).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import replace
from fcp.integrations.hf.families import family
from fcp.integrations.hf.mixers.rglru import RglruMixer, _BoundedSqrt
from tests.support.inputs import rel_err
from tests.support.packing import doc_ids_from_lengths, ref_segments


def _blocks():
    """Two copies of one randomly initialised transformers recurrent block (the tiny config's),
    every parameter set (the RG-LRU's are ``torch.empty`` until a model initialises them)."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf

    config = hf.RecurrentGemmaConfig(**dict(family("recurrent_gemma").test_config))
    torch.manual_seed(0)
    block = hf.RecurrentGemmaRecurrentBlock(config, 0)
    lru = block.rg_lru
    with torch.no_grad():
        for p in (lru.input_gate_weight, lru.recurrent_gate_weight):
            p.normal_(0.0, 0.5)
        for p in (lru.input_gate_bias, lru.recurrent_gate_bias, block.conv_1d.bias):
            p.normal_(0.0, 0.3)
        softplus = torch.logspace(-8, 0.7, config.lru_width)  # 1e-8 .. 5
        lru.recurrent_param.copy_(torch.log(torch.expm1(softplus.double())).float())
    theirs = hf.RecurrentGemmaRecurrentBlock(config, 0)
    theirs.load_state_dict(block.state_dict())
    replace(block, RglruMixer)
    return block, theirs


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_recurrent_block_equals_transformers_on_each_document():
    ours, theirs = _blocks()
    doc_ids = doc_ids_from_lengths([([5, 1, 3, 12, 2], 3), ([26], 0)])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 26, 32, generator=gen)
    real = (doc_ids != 0)[..., None]
    cot = torch.where(real, torch.randn(2, 26, 32, generator=gen), 0.0)  # no loss on padding
    xs = x.clone().requires_grad_()
    out, none = ours(xs, cp_context=PackedContext(doc_ids))
    assert none is None
    (out * cot).sum().backward()
    xr = x.clone().requires_grad_()
    for b in range(2):
        bounds = ref_segments(doc_ids[b].tolist())
        for s, e in zip(bounds[:-1], bounds[1:]):
            if doc_ids[b, s] == 0:
                continue  # the pad tail: nobody's document
            ref, _ = theirs(xr[b : b + 1, s:e], position_ids=torch.arange(e - s)[None],
                            attention_mask=None, use_cache=False)  # fmt: skip
            assert rel_err(out[b : b + 1, s:e], ref) <= 1e-5, (b, s, e)
            (ref * cot[b : b + 1, s:e]).sum().backward()
    assert rel_err(torch.where(real, xs.grad, 0.0), xr.grad) <= 1e-5
    mine, want = _grads(ours), _grads(theirs)
    scale = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        err = float((mine[name] - g).abs().max()) / max(float(g.abs().max()), 0.1 * scale)
        assert err <= 1e-5, (name, err)


def test_bounded_sqrt_is_transformers_sqrt_bound_derivative():
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import SqrtBoundDerivative

    x = torch.tensor([0.0, 1e-9, 2.4e-7, 1e-3, 0.5, 1.0], dtype=torch.float64)
    grads = []
    for fn in (_BoundedSqrt.apply, SqrtBoundDerivative.apply):
        t = x.clone().requires_grad_()
        fn(t).sum().backward()
        grads.append(t.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0][0] == 1000.0
