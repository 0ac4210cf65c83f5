"""bf16 autocast: every fcp operator and collective runs forward inside
``torch.autocast("cpu", torch.bfloat16)`` and backward outside it (what TRL's ``bf16=True`` and
accelerate's mixed precision do), on one process and on 2 gloo ranks.

For each operator the autocast run gets a model's mix of dtypes (activations bf16, parameters and
gates fp32), with values exactly representable in bf16, and the test asserts:

* outputs and gradients are finite, and each input's gradient has that input's dtype;
* the run equals, bitwise, the same call on the same tensors outside autocast (fcp's operators
  fix their own precision: fp32 states, scores and sums; :mod:`fcp.ops.kit.common`);
* its error against fp64 (the operator in fp64 on the same values and output gradient; relative
  Frobenius norm over the global tensors) is at most 1.05x that of a plain all-bf16 run in one
  process: ``property_tests/test_precision_properties.py``'s bound for bf16 under CP.

The indexers (integer outputs) select the same tokens under autocast as outside, with and
without CP. A compiled operator is one graph under autocast (no break). :mod:`fcp.scan`'s custom
ops, called directly, take mixed dtypes and autocast (their fake kernels agree: opcheck). The
collectives of :mod:`fcp.comm` are bitwise those of a run outside autocast on 2
and 4 ranks (``state_chain`` composes maps with matmuls from the third rank on). One transformers
model per mixer kind (KDA, Gated DeltaNet + GQA, Mamba2 SSD, gated short conv), enabled with
``fcp.integrations.hf.enable_packed_cp``, trains a step under autocast (one of them under CP 2):
its loss is within a bf16 tolerance of the fp32 loss and every parameter gradient is finite.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fcp
from fcp.context import PackedContext
from fcp.ops.kit.norms import rope_tables
from tests.support.packing import doc_ids_from_lengths

BF16 = torch.bfloat16
#: global tokens: 2 ranks of 32; documents straddle the rank boundary, and KDA / GLA run 4 chunks
#: of 8 per rank
SEQ = 64
DOC_IDS = doc_ids_from_lengths([([5, 30, 18, 7], 4)])
#: the precision property's bound: bf16 under CP within 1.05x one bf16 process
FACTOR = 1.05


def _r(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _u(gen, *shape):
    return torch.rand(*shape, generator=gen, dtype=torch.float64)


def _kda_inputs(gen, seq, gate):
    q, k = _r(gen, 1, seq, 2, 8), F.normalize(_r(gen, 1, seq, 2, 8), dim=-1)
    hv = 2 if gate == "key" else 4  # GDN: 2 q/k heads, 4 value heads (GVA)
    g_shape = (1, seq, hv, 8) if gate == "key" else (1, seq, hv)
    return {"q": q, "k": k, "v": _r(gen, 1, seq, hv, 8), "g": -4.0 * _u(gen, *g_shape) ** 3,
            "beta": _u(gen, 1, seq, hv)}  # fmt: skip


def _attention_inputs(gen, seq):
    return {"q": _r(gen, 1, seq, 4, 8), "k": _r(gen, 1, seq, 2, 8), "v": _r(gen, 1, seq, 2, 8)}


def make_inputs(name: str, seed: int) -> dict:
    """Global fp64 inputs of operator ``name`` holding bf16-representable values."""
    gen = torch.Generator().manual_seed(seed)
    if name == "short_conv":
        t = {"x": _r(gen, 1, SEQ, 8), "weight": _r(gen, 8, 4, scale=0.5),
             "bias": _r(gen, 8, scale=0.1)}  # fmt: skip
    elif name in ("kda", "gdn"):
        t = _kda_inputs(gen, SEQ, "key" if name == "kda" else "head")
    elif name == "gla":
        t = {"q": _r(gen, 1, SEQ, 1, 8), "k": _r(gen, 1, SEQ, 1, 8), "v": _r(gen, 1, SEQ, 2, 8),
             "a": -2.0 * _u(gen, 1, SEQ, 2)}  # fmt: skip
    elif name in ("doc_causal", "compressed"):
        t = _attention_inputs(gen, SEQ)
    elif name == "index_attention":
        t = dict(_attention_inputs(gen, SEQ), indices=torch.randint(-1, SEQ, (1, SEQ, 12),
                                                                    generator=gen))
    elif name == "kpool_indexer":
        t = {"index_q": _r(gen, 1, SEQ, 2, 8), "index_k": _r(gen, 1, SEQ, 8),
             "gate_logits": _r(gen, 1, SEQ, 8), "ape": _r(gen, 4, 8, scale=0.5),
             "head_weights": _r(gen, 1, SEQ, 2)}  # fmt: skip
    elif name == "qsa_indexer":
        cos, sin = rope_tables(PackedContext(DOC_IDS).position_ids, 4, dtype=torch.float64)
        t = {"index_q": _r(gen, 1, SEQ, 2, 8), "index_k": _r(gen, 1, SEQ, 8),
             "q_norm": _r(gen, 8, scale=0.3), "k_norm": _r(gen, 8, scale=0.3), "cos": cos,
             "sin": sin}  # fmt: skip
    else:
        raise ValueError(f"unknown operator name={name!r}")
    return {n: x.to(BF16).double() if x.is_floating_point() else x for n, x in t.items()}


#: the differentiable inputs of each operator whose gradients are compared
GRADS = {
    "short_conv": ("x", "weight", "bias"),
    "kda": ("q", "k", "v", "g", "beta"),
    "gdn": ("q", "k", "v", "g", "beta"),
    "gla": ("q", "k", "v", "a"),
    "doc_causal": ("q", "k", "v"),
    "compressed": ("q", "k", "v"),
    "index_attention": ("q", "k", "v"),
    "kpool_indexer": (),
    "qsa_indexer": (),
}
OPERATORS = tuple(n for n, g in GRADS.items() if g)
INDEXERS = tuple(n for n, g in GRADS.items() if not g)
#: inputs that are not per token (never sliced by rank; their gradients are per-rank partial
#: sums under CP)
PARAMS = ("weight", "bias", "ape", "q_norm", "k_norm")
#: inputs a model under autocast holds in fp32 (parameters, decays computed from them, RoPE
#: tables); every other floating input is bf16, as autocast's matmuls return it
FP32_UNDER_AUTOCAST = ("weight", "bias", "g", "a", "ape", "q_norm", "k_norm", "cos", "sin")


def call(name: str, t: dict, ctx: PackedContext) -> torch.Tensor:
    if name == "short_conv":
        return fcp.short_conv(t["x"], t["weight"], t["bias"], ctx, activation="silu")
    if name in ("kda", "gdn"):
        return fcp.kda(t["q"], t["k"], t["v"], t["g"], t["beta"], ctx, chunk_size=8)
    if name == "gla":
        return fcp.gla(t["q"], t["k"], t["v"], t["a"], ctx, chunk_size=8)
    if name == "doc_causal":
        return fcp.doc_causal_attention(t["q"], t["k"], t["v"], ctx)
    if name == "compressed":
        return fcp.compressed_attention(t["q"], t["k"], t["v"], ctx, ratio=2, window=3)
    if name == "index_attention":
        return fcp.index_attention(t["q"], t["k"], t["v"], t["indices"], ctx)
    if name == "kpool_indexer":
        return fcp.kpool_indexer(t["index_q"], t["index_k"], t["gate_logits"], t["ape"],
                                 t["head_weights"], ctx, topk=8, kpool=4)  # fmt: skip
    if name == "qsa_indexer":
        return fcp.qsa_indexer(t["index_q"], t["index_k"], t["q_norm"], t["k_norm"], t["cos"],
                               t["sin"], ctx, budget=8, ratio=4)  # fmt: skip
    raise ValueError(f"unknown operator name={name!r}")


def _context(env, doc_ids) -> PackedContext:
    if env is None:
        return PackedContext(doc_ids)
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def _dtype(mode: str, input_name: str) -> torch.dtype:
    if mode == "fp64":
        return torch.float64
    if mode == "bf16":
        return BF16
    return torch.float32 if input_name in FP32_UNDER_AUTOCAST else BF16


def run(env, name: str, inputs: dict, doc_ids, grad_out, modes: tuple[str, ...]) -> dict:
    """This rank's ``{mode: {"out": .., <input>: grad, "dtypes": {..}}}`` of ``sum(out *
    grad_out)`` (values as fp64). Modes: ``"fp64"``, ``"bf16"`` (every input), ``"mixed"`` (a
    model's dtypes under autocast, :data:`FP32_UNDER_AUTOCAST`) and ``"autocast"`` (the same
    tensors, forward inside ``torch.autocast``, backward outside). ``env=None``: one process."""
    ctx = _context(env, doc_ids)
    sl = slice(*ctx.interval)
    results = {}
    for mode in modes:
        t = {n: (x if n in PARAMS else x[:, sl]) for n, x in inputs.items()}
        t = {n: x.to(_dtype(mode, n), copy=True) if x.is_floating_point() else x.clone()
             for n, x in t.items()}  # fmt: skip
        for n in GRADS[name]:
            t[n].requires_grad_()
        with torch.autocast("cpu", BF16, enabled=mode == "autocast"):
            out = call(name, t, ctx)
        res = {"dtypes": {"out": out.dtype}}
        if GRADS[name]:
            (out * grad_out[:, sl].to(out.dtype)).sum().backward()  # outside the region
            out = out.double()
            for n in GRADS[name]:
                res[n] = t[n].grad.double()
                res["dtypes"][n] = (t[n].grad.dtype, t[n].dtype)
        res["out"] = out.detach()
        results[mode] = res
    return results


def _global(key: str, per_rank: list):
    """Per-token results concatenated in rank order; parameter gradients summed."""
    if key in PARAMS:
        return sum(per_rank)
    return torch.cat(per_rank, 1)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def operator_errors(rank_pool, name: str, world: int, seed: int = 0):
    """``(errors, results)``: ``{key: (autocast error, plain bf16 one-process error)}`` against
    fp64 for the output and every input gradient, and every rank's results."""
    inputs = make_inputs(name, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = call(name, inputs, PackedContext(DOC_IDS)).shape
    grad_out = torch.randn(shape, generator=gen, dtype=torch.float64).to(BF16).double()
    ref = run(None, name, inputs, DOC_IDS, grad_out, ("fp64", "bf16"))
    modes = ("mixed", "autocast")
    if world == 1:
        ranks = [run(None, name, inputs, DOC_IDS, grad_out, modes)]
    else:
        ranks = rank_pool.run(run, world, name, inputs, DOC_IDS, grad_out, modes)
    errors = {}
    for key in ("out", *GRADS[name]):
        got = _global(key, [r["autocast"][key] for r in ranks])
        errors[key] = (_rel(got, ref["fp64"][key]), _rel(ref["bf16"][key], ref["fp64"][key]))
    return errors, ranks


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", OPERATORS)
def test_operator_under_autocast(rank_pool, name, world):
    errors, ranks = operator_errors(rank_pool, name, world)
    for rank, r in enumerate(ranks):
        ac, mixed = r["autocast"], r["mixed"]
        for key in ("out", *GRADS[name]):
            assert ac[key].isfinite().all(), f"{name} rank {rank}: {key} not finite"
            # fcp's operators fix their own precision: autocast changes nothing, bitwise
            assert torch.equal(ac[key], mixed[key]), f"{name} rank {rank}: {key} differs"
        for n in GRADS[name]:
            grad_dtype, input_dtype = ac["dtypes"][n]
            assert grad_dtype == input_dtype, f"{name}: {n}.grad is {grad_dtype}, not {input_dtype}"
    for key, (err, bf16) in errors.items():
        assert err <= FACTOR * bf16, f"{name} {key} (CP {world}): {err:.3g} vs bf16 {bf16:.3g}"


@pytest.mark.parametrize("name", INDEXERS)
def test_indexer_selects_the_same_tokens_under_autocast(rank_pool, name):
    inputs = make_inputs(name, 0)
    grad_out = torch.zeros(())
    one = run(None, name, inputs, DOC_IDS, grad_out, ("mixed", "autocast"))
    ranks = rank_pool.run(run, 2, name, inputs, DOC_IDS, grad_out, ("autocast",))
    got = one["autocast"]["out"]
    assert got.dtype == torch.int64 and (got >= 0).any()
    assert torch.equal(got, one["mixed"]["out"])
    assert torch.equal(torch.cat([r["autocast"]["out"] for r in ranks], 1), got)  # CP 2


def test_compiled_under_autocast_is_one_graph():
    """Gated DeltaNet compiled (``fullgraph=True``, aot_eager) and run inside autocast: one graph,
    no break; the forward bitwise the eager one. PyTorch traces the backward with the forward's
    autocast (its default ``backward_pass_autocast="same_as_forward"``), so autograd's matmuls of
    the chunk forms run in bf16 there: gradients within 3x a plain bf16 run's error against fp64
    (measured 1.7-2.6x; with ``"off"`` the compiled run equals the eager one, bitwise)."""
    import torch._dynamo.testing

    name, ctx = "gdn", PackedContext(DOC_IDS)
    inputs = make_inputs(name, 0)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64).to(BF16)
    ref = run(None, name, inputs, DOC_IDS, grad_out.double(), ("fp64", "bf16", "autocast"))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: call(name, t, ctx), backend=counter, fullgraph=True)
    t = {n: x.to(_dtype("mixed", n), copy=True).requires_grad_() for n, x in inputs.items()}
    with torch.autocast("cpu", BF16):
        out = compiled(t)
    (out * grad_out).sum().backward()
    assert counter.frame_count == 1
    assert torch.equal(out.detach().double(), ref["autocast"]["out"])
    for n in GRADS[name]:
        grad = t[n].grad
        assert grad.dtype == t[n].dtype and grad.isfinite().all(), (n, grad.dtype)
        err, bf16 = (_rel(x, ref["fp64"][n]) for x in (grad.double(), ref["bf16"][n]))
        assert err <= 3 * bf16, f"{n}: compiled {err:.3g} vs bf16 {bf16:.3g}"


def test_scan_ops_take_mixed_dtypes_and_autocast():
    """fcp.scan's custom ops called directly: mixed bf16/fp32 inputs compute in fp32 (their fake
    kernels agree: opcheck), under autocast as outside (autocast's fp32 rule, registered), and
    each input's gradient has that input's dtype."""
    from fcp import scan

    gen = torch.Generator().manual_seed(0)
    dtypes = (BF16, torch.float32, BF16, torch.float32, BF16)  # w, u0, kd, dec, s0
    shapes = ((2, 5, 3, 4), (2, 5, 3, 6), (2, 5, 3, 4), (2, 5, 4), (2, 4, 6))
    chunk = [(torch.rand if i == 3 else torch.randn)(*s, generator=gen).to(d)
             for i, (s, d) in enumerate(zip(shapes, dtypes))]  # fmt: skip
    decay = [torch.rand(2, 5, 1, 1, generator=gen).to(BF16), torch.randn(2, 5, 4, 6,
             generator=gen), torch.randn(2, 4, 6, generator=gen).to(BF16)]  # fmt: skip
    states, pseudo, final, a, upper = scan.chunk_scan_fwd(*chunk)
    assert states.dtype == torch.float32
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(scan.chunk_scan_fwd, chunk, test_utils=utils)
    g_states = torch.randn(states.shape, generator=gen).to(BF16)
    torch.library.opcheck(scan.chunk_scan_bwd, (chunk[0], chunk[2], states, pseudo, a, upper,
                                                g_states, None, final, True), test_utils=utils)
    torch.library.opcheck(scan.decay_scan_fwd, decay, test_utils=utils)
    b_states, b_final = scan.decay_scan_fwd(*decay)
    torch.library.opcheck(scan.decay_scan_bwd, (b_states, *decay, b_states.to(BF16), None),
                          test_utils=utils)  # fmt: skip
    for fn, xs in ((scan.chunk_scan, chunk), (scan.decay_scan, decay)):
        results = []
        for autocast in (False, True):
            leaves = [x.clone().requires_grad_() for x in xs]
            with torch.autocast("cpu", BF16, enabled=autocast):
                outs = fn(*leaves)
            sum(o.sum() for o in outs).backward()
            assert all(o.dtype == torch.float32 for o in outs)
            assert all(x.grad.dtype == x.dtype for x in leaves)
            results.append([*outs, *(x.grad for x in leaves)])
        assert all(torch.equal(x, y) for x, y in zip(*results))


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
def collectives(env, inputs: dict, cots: dict, autocast: bool) -> dict:
    """This rank's outputs of fcp.comm's collectives and the gradients of ``sum(out * cot)``,
    forward inside autocast when ``autocast`` (backward outside)."""
    ctx = _context(env, DOC_IDS)
    sl = slice(*ctx.interval)
    x = inputs["x"][:, sl].to(BF16).requires_grad_()
    x32 = inputs["x"][:, sl].float().requires_grad_()
    lead = (1, 2)  # [batch, heads]
    m = inputs["m"][env.rank].to(BF16).requires_grad_()  # this rank's transition and state
    s = inputs["s"][env.rank].float().requires_grad_()
    with torch.autocast("cpu", BF16, enabled=autocast):
        outs = {"halo": fcp.left_halo(x, ctx, history=3),
                "halo_wide": fcp.comm.with_left_halo(x, ctx, 3, dtype=torch.float32),
                "gather": fcp.all_gather_sequence(x32, ctx),
                "gather_wide": fcp.all_gather_sequence(x, ctx, dtype=torch.float32),
                "chain": fcp.state_chain(m.view(*lead, 4, 4), s.view(*lead, 4, 5), ctx)}
    loss = sum((o * cots[k][env.rank].to(o.dtype)).sum() for k, o in outs.items())
    loss.backward()
    leaves = {"x": x, "x32": x32, "m": m, "s": s}
    return {"out": {k: (o.dtype, o.detach()) for k, o in outs.items()},
            "grad": {k: (t.dtype, t.grad.dtype, t.grad) for k, t in leaves.items()}}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_under_autocast(rank_pool, world):
    gen = torch.Generator().manual_seed(7)
    inputs = {"x": _r(gen, 1, SEQ, 4), "m": 0.5 * _r(gen, world, 2 * 16), "s": _r(gen, world, 40)}
    local = SEQ // world
    shapes = {"halo": (1, 3, 4), "halo_wide": (1, 3 + local, 4), "gather": (1, SEQ, 4),
              "gather_wide": (1, SEQ, 4), "chain": (1, 2, 4, 5)}  # fmt: skip
    cots = {k: _r(gen, world, *s) for k, s in shapes.items()}
    plain = rank_pool.run(collectives, world, inputs, cots, False)
    ac = rank_pool.run(collectives, world, inputs, cots, True)
    for rank, (p, a) in enumerate(zip(plain, ac)):
        for kind in ("out", "grad"):
            for key, want in p[kind].items():
                got = a[kind][key]
                assert got[:-1] == want[:-1], f"rank {rank} {key}: dtypes {got[:-1]} != {want[:-1]}"
                assert got[-1].isfinite().all() and torch.equal(got[-1], want[-1]), (rank, key)
        for key, (dtype, grad_dtype, _) in a["grad"].items():
            assert grad_dtype == dtype, f"rank {rank}: {key}.grad is {grad_dtype}, not {dtype}"
        assert a["out"]["chain"][0] == torch.float32  # the chain accumulates in fp32


# ---------------------------------------------------------------------------------------------
# transformers models
# ---------------------------------------------------------------------------------------------
HF_SEQ = 24


def hf_batch(seed: int = 0) -> tuple[dict, torch.Tensor]:
    """A packed batch (two rows: three documents; one document and a pad tail) and a random
    target per token."""
    gen = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(1, 128, (2, HF_SEQ), generator=gen),
             "seq_lens": torch.tensor([[7, 12, 5], [HF_SEQ - 3, -1000, -1000]])}  # fmt: skip
    return batch, torch.randint(0, 128, (2, HF_SEQ), generator=gen)


def _targets(targets: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """This rank's targets; tokens outside a document (doc id 0) get -100."""
    full = torch.full(ctx.doc_ids.shape, -100, dtype=torch.int64)
    full[:, : targets.shape[1]] = targets
    return torch.where(ctx.doc_ids == 0, -100, full)[:, slice(*ctx.interval)]


def hf_step(env, family: str, config: dict, batch: dict, targets: torch.Tensor,
            head: torch.Tensor, tokens: int, autocast: bool) -> dict:
    """This rank's part of ``cross_entropy(hidden @ head, targets)`` (summed over its tokens,
    divided by the batch's ``tokens``) for transformers' ``family`` enabled with
    ``enable_packed_cp``, forward inside autocast when ``autocast``, backward outside; and the
    names of its parameters whose gradients are missing or not finite."""
    from fcp.integrations.hf import enable_packed_cp
    from tests.support.hf_reference import build

    model = enable_packed_cp(build(family, config))
    local, ctx = fcp.shard_batch(None if env is None else env.group, batch)
    with torch.autocast("cpu", BF16, enabled=autocast):
        hidden = model(input_ids=local["input_ids"], cp_context=ctx,
                       use_cache=False).last_hidden_state  # fmt: skip
        logits = (hidden @ head).float()
    loss = F.cross_entropy(logits.flatten(0, 1), _targets(targets, ctx).flatten(),
                           reduction="sum")  # fmt: skip
    (loss / tokens).backward()
    params = dict(model.named_parameters())
    return {"loss": loss.item() / tokens,
            "missing": [n for n, p in params.items() if p.grad is None],
            "nonfinite": [n for n, p in params.items()
                          if p.grad is not None and not p.grad.isfinite().all()]}  # fmt: skip


def _hf_family(family: str) -> dict:
    from tests.support import hf_reference as ref

    return {"kimi_linear": ref.KIMI_TINY, "qwen3_5": ref.QWEN3_5_TINY,
            "nemotron_h": ref.NEMOTRON_H_TINY, "lfm2": ref.LFM2_TINY}[family]  # fmt: skip


#: bf16's unit roundoff, relative to the loss (~5.5): the whole model's autocast against fp32
#: measured 1.8e-5 (Kimi-Linear) to 2.5e-4 (Qwen3.5), CP 2 equal to one process
HF_RTOL = 2.0**-8


# CP 2 on LFM2: rank processes import its transformers modules in ~5 s, the GDN and KDA models'
# (which import FLA's layers) in ~18 s on this machine; fcp's KDA under CP is tested above
@pytest.mark.parametrize(("family", "world"), [("kimi_linear", 1), ("qwen3_5", 1),
                                               ("nemotron_h", 1), ("lfm2", 2)])  # fmt: skip
def test_transformers_model_trains_under_autocast(rank_pool, family, world):
    config, (batch, targets) = _hf_family(family), hf_batch()
    head = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) / 32**0.5
    tokens = int((_targets(targets, fcp.shard_batch(None, batch)[1]) != -100).sum())
    args = (family, config, batch, targets, head, tokens)
    want = hf_step(None, *args, autocast=False)
    if world == 1:
        ranks = [hf_step(None, *args, autocast=True)]
    else:
        ranks = rank_pool.run(hf_step, world, *args, True)
    loss = sum(r["loss"] for r in ranks)
    assert abs(loss - want["loss"]) <= HF_RTOL * abs(want["loss"]), (loss, want["loss"])
    for rank, r in enumerate(ranks):
        assert not r["nonfinite"], f"rank {rank}: non-finite gradients {r['nonfinite']}"
        assert r["missing"] == want["missing"], f"rank {rank}: no gradient for {r['missing']}"
