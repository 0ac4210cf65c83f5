"""Rank functions of the transformers-integration tests (fcp's packed, CP model on each rank) and of
the PLE dilated-conv tests of NeMo's Qwen3.8-Flash-Next (`tests/test_ple_conv.py`)."""

from __future__ import annotations

import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests.support.hf_reference import build, per_document_jobs

#: seconds a pool job may take (the first compiles on 4 ranks sharing 2 cores)
POOL_TIMEOUT_S = 120


def documents(lengths: list[int], hidden: int, seed: int) -> dict:
    """A pool of random documents of ``lengths`` (token ids in ``[1, 128)``) and their cotangents
    ``[n, hidden]``: ``{"docs": [...], "cots": [...]}``, what :func:`pack` reads."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 128, (n,), generator=gen) for n in lengths]
    return {"docs": docs, "cots": [torch.randn(n, hidden, generator=gen) for n in lengths]}


def pack(reference: dict, rows: list[list[int]], seq: int):
    """A packed batch of the reference's documents ``rows`` (indices into ``reference["docs"]``),
    right-padded to ``seq``, and the matching cotangent ``[batch, seq, hidden]``."""
    hidden = reference["cots"][0].shape[-1]
    ids, cot, lens = [], [], []
    for row in rows:
        docs = [reference["docs"][i] for i in row]
        pad = seq - sum(len(d) for d in docs)
        ids.append(torch.cat(docs + [torch.zeros(pad, dtype=torch.long)]))
        cot.append(torch.cat([reference["cots"][i] for i in row] + [torch.zeros(pad, hidden)]))
        lens.append([len(d) for d in docs])
    width = max(len(x) for x in lens)
    seq_lens = torch.tensor([x + [-1000] * (width - len(x)) for x in lens])
    return {"input_ids": torch.stack(ids), "seq_lens": seq_lens}, torch.stack(cot)


def check(reference: dict, rows: list[list[int]], results: list) -> float:
    """Per-document parity of the ranks' ``results`` (``packed_forward_backward``) with the
    reference: outputs to 1e-5; summed parameter gradients to 1e-5 relative to the larger of the
    tensor's largest entry and a tenth of the model's largest gradient entry (fp32 rounding of
    differently ordered sums: a tensor of tiny gradients sums products that cancel). Returns the
    largest gradient error."""
    out = torch.cat([r[0] for r in results], 1)
    grads = {n: sum(r[1][n] for r in results) for n in results[0][1]}
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(reference["docs"][i])
            torch.testing.assert_close(out[b, start : start + n], reference["outputs"][i],
                                       atol=1e-5, rtol=1e-5)  # fmt: skip
            start += n
    want = {}
    for row in rows:
        for i in row:
            for name, g in reference["grads"][i].items():
                want[name] = want.get(name, 0) + g
    # a parameter transformers never reaches on these documents (DeepSeek-V4's compressors on
    # documents shorter than a pool) has no gradient there and an exact zero one in fcp, whose
    # static shapes always run the path
    assert want.keys() <= grads.keys(), sorted(want.keys() - grads.keys())
    assert not any(grads[n].any() for n in grads.keys() - want.keys())
    grads = {n: grads[n] for n in want}
    scale = max(float(w.abs().max()) for w in want.values())
    errs = {}
    for name, g in grads.items():
        den = max(float(want[name].abs().max()), 0.1 * scale)
        errs[name] = float((g - want[name]).abs().max()) / den
        assert errs[name] <= 1e-5, (name, errs[name])
    return max(errs.values())


def output_error(reference: dict, rows: list[list[int]], results: list) -> float:
    """The largest per-document output difference, relative to the largest reference entry."""
    out = torch.cat([r[0] for r in results], 1)
    errs = []
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            want = reference["outputs"][i]
            got = out[b, start : start + len(want)]
            errs.append(float((got - want).abs().max() / want.abs().max()))
            start += len(want)
    return max(errs)


def check_spanning_every_rank(rank_pool, reference: dict, family: str, config: dict, world: int,
                              rows=((7, 0), (6, 1, 3)), seq: int = 41) -> None:  # fmt: skip
    """:func:`check` on a packing where one document spans every rank; by default (``reference``
    made from the shared ``LENGTHS``) the 37-token one next to a 1-token one, and a row of
    documents shorter than a conv (22, 2, 5 tokens) with a pad tail. Prints the measured
    errors."""
    rows = [list(row) for row in rows]
    results = run(rank_pool, reference, family, config, world, rows, seq)
    grad_err = check(reference, rows, results)
    out_err = output_error(reference, rows, results)
    print(f"\n[hf-{family}] {world} rank(s): max relative output error {out_err:.1e}, "
          f"max relative parameter-gradient error {grad_err:.1e}")  # fmt: skip


def check_replacement(family: str, config: dict, kinds: dict):
    """The replacement contract on a fresh ``family`` model, whose supported transformers mixer
    classes must be the keys of ``kinds`` (``{class name: fcp mixer kind}``): ``enable_packed_cp``
    returns the model, keeps its state-dict keys, values, buffers and parameter objects, loads
    the old state dict strictly, swaps each mixer's class to ``Packed<HFClass>``, a subclass of
    its kind (one class per kind), and is idempotent. Returns the model."""
    from fcp.integrations.hf import SUPPORTED, FcpMixer

    model = build(family, config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    buffers = [n for n, _ in model.named_buffers()]
    hf_classes = {n: type(m) for n, m in model.named_modules() if type(m).__name__ in SUPPORTED}
    assert sorted({c.__name__ for c in hf_classes.values()}) == sorted(kinds)
    assert enable_packed_cp(model) is model
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())
    assert [n for n, _ in model.named_buffers()] == buffers  # RoPE adds no buffer
    assert all(p is params[n] for n, p in model.named_parameters())  # optimizers stay valid
    assert not model.load_state_dict(before, strict=True).missing_keys  # strict: raises otherwise
    swapped = {n: type(model.get_submodule(n)) for n in hf_classes}
    assert sorted(n for n, m in model.named_modules() if isinstance(m, FcpMixer)) == sorted(swapped)
    for name, hf_class in hf_classes.items():
        assert swapped[name].__name__ == f"Packed{hf_class.__name__}"
        assert swapped[name].__bases__ == (SUPPORTED[hf_class.__name__], hf_class)
        assert issubclass(swapped[name], kinds[hf_class.__name__]), (name, swapped[name])
    assert len(set(swapped.values())) == len(kinds)  # one class per kind, shared by its layers
    assert enable_packed_cp(model) is model  # idempotent
    assert {n: type(model.get_submodule(n)) for n in hf_classes} == swapped
    return model


def compile_counts(family: str, config: dict, steps: int) -> tuple[list, int]:
    """Every mixer of a packed ``family`` model compiled as the demo does (``mixer.compile``,
    fullgraph, aot_eager), the model run over ``steps`` packings of one shape (outputs checked
    against eager's to 1e-5): ``(compiled frames after each step, number of (mixer class, layer
    type) pairs)``."""
    import torch._dynamo.testing

    from fcp.integrations.hf import FcpMixer
    from tests.test_hf_core import packed_batch

    model, eager = (enable_packed_cp(build(family, config)) for _ in range(2))
    names = [n for n, m in model.named_modules() if isinstance(m, FcpMixer)]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for name in names:
        model.get_submodule(name).compile(backend=counter, fullgraph=True, dynamic=False)
    counts = []
    with torch.no_grad():
        for step in range(steps):
            local, ctx = packed_batch(20 + step)
            got, want = (m(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
                         for m in (model, eager))  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            counts.append(counter.frame_count)
    # one graph per mixer class and layer type: a sliding and a full layer of one class take
    # different paths (their window is a constant of the graph)
    mixers = [model.get_submodule(n) for n in names]
    return counts, len({(type(m), getattr(m, "layer_type", None)) for m in mixers})


def packed_model(family: str, config: dict, state_dict: dict):
    model = build(family, config)
    model.load_state_dict(state_dict)
    return enable_packed_cp(model)


def packed_forward_backward(env, family, config, state_dict, batch, cotangent):
    """This rank's outputs and parameter gradients for ``sum(output * cotangent)`` (``env=None``:
    one process). ``cotangent`` ``[batch, seq, hidden]`` is global; gradients are this rank's
    partial sums."""
    model = packed_model(family, config, state_dict)
    group = None if env is None else env.group
    local, ctx = fcp.shard_batch(group, batch)
    out = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False).last_hidden_state
    cot = ctx.shard(cotangent)
    (out * cot).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, ctx.interval


def references(configs: dict, lengths: list[int], hidden: int, seed: int,
               families: dict | None = None) -> dict:  # fmt: skip
    """``{family: reference}`` for ``configs`` (``{family: config}``): one pool of random
    documents of ``lengths`` and cotangents ``[n, hidden]`` shared by all families, each
    family's initial state dict, and transformers' per-document outputs and gradients
    (:func:`~tests.support.hf_reference.per_document_jobs`, one subprocess for all).
    ``families`` maps a key of ``configs`` that is not a family name (a configuration variant)
    to its family."""
    family = (families or {}).get
    pool = documents(lengths, hidden, seed)
    docs, cots = pool["docs"], pool["cots"]
    states = {f: {k: v.clone() for k, v in build(family(f, f), c).state_dict().items()}
              for f, c in configs.items()}  # fmt: skip
    refs = per_document_jobs([dict(family=family(f, f), config=c, state_dict=states[f],
                                   documents=docs, cotangents=cots)
                              for f, c in configs.items()])  # fmt: skip
    return {f: dict(state=states[f], docs=docs, cots=cots, **r) for f, r in zip(configs, refs)}


def run(rank_pool, reference: dict, family: str, config: dict, world: int, rows, seq: int,
        timeout: float = POOL_TIMEOUT_S) -> list:  # fmt: skip
    """Every rank's :func:`packed_forward_backward` for the packing ``rows`` of ``reference``'s
    documents (``world == 1``: in this process)."""
    args = (family, config, reference["state"], *pack(reference, rows, seq))
    if world == 1:
        return [packed_forward_backward(None, *args)]
    return rank_pool.run(packed_forward_backward, world, *args, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Qwen3.8-Flash-Next's PLE dilated conv (tests/test_ple_conv.py): fcp.short_conv with dilation
# ---------------------------------------------------------------------------------------------
def dilated_conv_fwd_bwd(env, x_full, weight, doc_ids, dilation, grad_full):
    """This rank's ``silu(short_conv(x, weight, dilation=...))`` shard, its input gradient and
    its partial weight gradient for ``sum(out * grad)`` (``env=None``: one process)."""
    from fcp.context import PackedContext
    from fcp.ops.conv import short_conv

    if env is None:
        ctx = PackedContext(doc_ids)
    else:
        ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    x = ctx.shard(x_full).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    y = short_conv(x, w, None, ctx, activation="silu", dilation=dilation)
    (y * ctx.shard(grad_full)).sum().backward()
    return y.detach(), x.grad, w.grad
