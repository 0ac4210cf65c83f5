"""transformers' Mamba1 models (Mamba, Falcon-Mamba) on fcp: what the parity battery does not
cover.

Every family's per-document parity on 1, 2 and 4 ranks, replacement contract and guard are in
``tests/test_hf_families.py`` / ``tests/test_hf_core.py``. Here:

* the documented mapping of the selective scan onto :func:`fcp.ops.gla.gla` (heads = channels,
  keys = the state, one value, ``a = dt A`` per key) against transformers' own PyTorch scan
  (``mamba_selective_scan``, run per document), outputs and the gradients of x, dt, B, C, z and
  of A_log, D and the dt bias, with moderate and strong decays (median ``dt A < -8``): 1e-5;
* the compiled Mamba1 layers (``mixer.compile``, fullgraph, aot_eager): one graph over 5
  packings, equal to eager (the operator: 10 packings, ``tests/test_gla_keyed.py``);
* the ``*ForCausalLM`` wrapper, whose forward drops ``**kwargs`` in transformers: its logits are
  transformers' per document, its loss comes from ``shift_labels``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fcp
from fcp.context import PackedContext
from fcp.integrations.hf import enable_packed_cp
from fcp.ops.gla import gla
from tests.support.hf_reference import build
from tests.support.hf_families import FAMILIES
from tests.support.inputs import rel_err
from tests.support.packing import doc_ids_from_lengths, ref_segments


def _runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    bounds = ref_segments(ids.tolist())
    return list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("strong", [False, True])
def test_selective_scan_mapping_matches_transformers(strong):
    from transformers.models.mamba import modeling_mamba

    scan = inspect.unwrap(modeling_mamba.mamba_selective_scan)  # the PyTorch loop itself
    channels, n_state = 6, 8
    doc_ids = doc_ids_from_lengths([([5, 30, 1, 17], 3)])
    length = doc_ids.shape[1]
    gen = torch.Generator().manual_seed(5)
    xs = dict(x=torch.randn(1, length, channels, generator=gen),
              dt=torch.randn(1, length, channels, generator=gen),
              B=torch.randn(1, length, n_state, generator=gen),
              C=torch.randn(1, length, n_state, generator=gen),
              z=torch.randn(1, length, channels, generator=gen),
              A_log=torch.log(torch.arange(1.0, n_state + 1)).expand(channels, -1)
              + (2.0 if strong else 0.0) + 0.1 * torch.randn(channels, n_state, generator=gen),
              D=torch.randn(channels, generator=gen),
              dt_bias=torch.full((channels,), 1.0 if strong else -3.0))  # fmt: skip
    ctx = PackedContext(doc_ids)

    def fcp_mamba1(*values):  # the mapping of fcp.integrations.hf.mixers.mamba1
        t = dict(zip(xs, values))
        dt = torch.nn.functional.softplus(t["dt"] + t["dt_bias"])
        a = dt[..., None] * -torch.exp(t["A_log"])
        y = gla(t["C"][:, :, None], t["B"][:, :, None], (dt * t["x"])[..., None], a, ctx,
                scale=1.0, chunk_size=16)[..., 0]  # fmt: skip
        return (y + t["x"] * t["D"]) * torch.nn.functional.silu(t["z"])

    def transformers_per_document(*values):
        t = dict(zip(xs, values))
        pieces = [scan(t["x"][:, s:e].transpose(1, 2), t["dt"][:, s:e].transpose(1, 2),
                       -torch.exp(t["A_log"]), t["B"][:, s:e].transpose(1, 2),
                       t["C"][:, s:e].transpose(1, 2), t["D"], t["z"][:, s:e].transpose(1, 2),
                       delta_bias=t["dt_bias"], delta_softplus=True).transpose(1, 2)
                  for s, e in _runs(doc_ids[0])]  # fmt: skip
        return torch.cat(pieces, 1)

    grad_out = torch.randn(1, length, channels, generator=gen)

    def out_and_grads(fn):
        leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
        out = fn(*leaves.values())
        (out * grad_out).sum().backward()
        return out.detach(), {n: x.grad for n, x in leaves.items()}

    out, grads = out_and_grads(fcp_mamba1)
    ref, ref_grads = out_and_grads(transformers_per_document)
    errs = {"out": rel_err(out, ref)} | {n: rel_err(grads[n], ref_grads[n]) for n in xs}
    assert max(errs.values()) <= 1e-5, errs
    if strong:  # most of the state is forgotten at every token
        a = torch.nn.functional.softplus(xs["dt"] + xs["dt_bias"])[..., None] * -xs["A_log"].exp()
        assert a.median() < -8


def _batch(seed: int, seq: int = 24):
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq - 2, generator=gen)[:2].sort().values + 1
    lens = torch.tensor([[int(cuts[0]), int(cuts[1] - cuts[0]), seq - int(cuts[1])]])
    ids = torch.randint(1, 128, (1, seq), generator=gen)
    return fcp.shard_batch(None, {"input_ids": ids, "labels": ids, "seq_lens": lens})


def test_compiled_mamba1_layers_compile_once_over_packings():
    import torch._dynamo.testing

    from fcp.integrations.hf.mixers import Mamba1Mixer

    config = FAMILIES["falcon_mamba"].config
    model, eager = (enable_packed_cp(build("falcon_mamba", config)) for _ in range(2))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    mixers = [m for m in model.modules() if isinstance(m, Mamba1Mixer)]
    for mixer in mixers:
        mixer.compile(backend=counter, fullgraph=True, dynamic=False)
    counts = []
    with torch.no_grad():
        for step in range(5):
            local, ctx = _batch(30 + step)
            got, want = (m(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
                         for m in (model, eager))  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            counts.append(counter.frame_count)
    assert counts == [1] * 5, counts


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_causal_lm_logits_and_loss(family):
    import transformers

    backbone = build(family, FAMILIES[family].config)
    lm = getattr(transformers, FAMILIES[family].causal_lm)(backbone.config).eval()
    lm.base_model.load_state_dict(backbone.state_dict())
    ref = getattr(transformers, FAMILIES[family].causal_lm)(backbone.config).eval()
    ref.load_state_dict(lm.state_dict())
    enable_packed_cp(lm)
    local, ctx = _batch(3)
    out = lm(**local, cp_context=ctx)
    ids, lens = local["input_ids"], [e - s for s, e in _runs(ctx.doc_ids[0])]
    logits, losses, s = [], [], 0
    for n in lens:
        piece = ref(input_ids=ids[:, s:s + n], labels=ids[:, s:s + n])
        logits.append(piece.logits)
        if n > 1:
            losses.append((piece.loss * (n - 1), n - 1))
        s += n
    torch.testing.assert_close(out.logits, torch.cat(logits, 1), atol=1e-5, rtol=1e-5)
    want = sum(l for l, _ in losses) / sum(c for _, c in losses)
    torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=1e-5)
