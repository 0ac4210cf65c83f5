"""Rank functions of the transformers-integration tests (fcp's packed, CP model on each rank) and of
the PLE dilated-conv tests of NeMo's Qwen3.8-Flash-Next (`tests/test_ple_conv.py`)."""

from __future__ import annotations

import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests.support.hf_reference import build, per_document_jobs


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
    assert grads.keys() == want.keys()
    scale = max(float(w.abs().max()) for w in want.values())
    errs = {}
    for name, g in grads.items():
        den = max(float(want[name].abs().max()), 0.1 * scale)
        errs[name] = float((g - want[name]).abs().max()) / den
        assert errs[name] <= 1e-5, (name, errs[name])
    return max(errs.values())


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
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 128, (n,), generator=gen) for n in lengths]
    cots = [torch.randn(n, hidden, generator=gen) for n in lengths]
    states = {f: {k: v.clone() for k, v in build(family(f, f), c).state_dict().items()}
              for f, c in configs.items()}  # fmt: skip
    refs = per_document_jobs([dict(family=family(f, f), config=c, state_dict=states[f],
                                   documents=docs, cotangents=cots)
                              for f, c in configs.items()])  # fmt: skip
    return {f: dict(state=states[f], docs=docs, cots=cots, **r) for f, r in zip(configs, refs)}


def run(rank_pool, reference: dict, family: str, config: dict, world: int, rows, seq: int,
        timeout: float) -> list:  # fmt: skip
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
