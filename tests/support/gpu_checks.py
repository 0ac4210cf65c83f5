"""What the CUDA tests of fcp's FLA backends share (``tests/test_fla_gpu.py``,
``tests/test_gla_gpu.py``): packed rows, the backends' tolerances, output-and-gradient errors, and
the CUDA-graph training-step check.

Error metric: :func:`tests.support.inputs.rel_err` (``max |x - ref| / max |ref|``) per tensor.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from tests.support.inputs import rel_err
from tests.support.packing import doc_ids_from_lengths

#: ``dtype -> (output, gradient)`` tolerances of an FLA backend against fcp's fp32 PyTorch code:
#: FLA runs its fp32 matmuls in TF32 and keeps chunk states in the input dtype
TOLS = {torch.float32: (5e-3, 1e-2), torch.bfloat16: (2e-2, 4e-2)}


def packed_rows(seq: int, seed: int) -> torch.Tensor:
    """Row 0: short documents (1-40 tokens), a long one, a pad tail. Row 1: two long documents."""
    gen = torch.Generator().manual_seed(seed)
    lens, used = [], 0
    while used < seq // 2:
        lens.append(int(torch.randint(1, 41, (1,), generator=gen)))
        used += lens[-1]
    lens.append(seq - used - 37)
    return doc_ids_from_lengths([(lens, 37), ([seq // 3, seq - seq // 3], 0)])


def out_and_grads(fn, inputs: dict, names, dtype, grad_out):
    """``(out, {name: gradient})`` of ``fn(*inputs in names order)`` on the inputs cast to
    ``dtype``, for ``sum(out * grad_out)``."""
    xs = {n: x.to(dtype).clone().requires_grad_() for n, x in inputs.items()}
    out = fn(*(xs[n] for n in names))
    grads = torch.autograd.grad(out, [xs[n] for n in names], grad_out.to(out.dtype))
    return out.detach(), dict(zip(names, grads))


def errors(fn, ref, inputs: dict, names, dtype, grad_out) -> dict:
    """Errors of ``fn`` in ``dtype`` against ``ref`` in fp32: ``{"out": .., name: ..}``; ``fn``'s
    output and gradients must be finite."""
    out, grads = out_and_grads(fn, inputs, names, dtype, grad_out)
    want, want_grads = out_and_grads(ref, inputs, names, torch.float32, grad_out)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads.values())
    return {"out": rel_err(out, want)} | {n: rel_err(grads[n], want_grads[n]) for n in names}


def assert_within(errs: dict, dtype) -> None:
    """:func:`errors` within :data:`TOLS` of ``dtype``."""
    tol_out, tol_grad = TOLS[dtype]
    assert errs["out"] <= tol_out, errs
    assert max(v for k, v in errs.items() if k != "out") <= tol_grad, errs


def check_cuda_graph_replays(model: torch.nn.Module, label: str) -> None:
    """A ``torch.compile(mode="reduce-overhead", fullgraph=True)`` training step of ``model`` (a
    bf16 CUDA module taking ``(x [2, 512, 256], context)``): CUDA graphs captured once (one graph,
    no cudagraph skips), replayed for three packings without recompiling, each step's output and
    parameter gradients equal to eager's (bf16 tolerances)."""
    from torch._dynamo.utils import counters

    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)

    def step(fn, doc):
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        y = fn(x, PackedContext(doc))
        y.float().pow(2).mean().backward()
        return y.detach().clone(), [p.grad.clone() for p in model.parameters()]

    packings = [packed_rows(512, seed=s).cuda() for s in (7, 8, 9)]
    for doc in packings + packings:  # second pass: pure replays
        y_c, g_c = step(compiled, doc)
        y_e, g_e = step(model, doc)
        assert rel_err(y_c, y_e) <= TOLS[torch.bfloat16][0]
        assert all(rel_err(a, b) <= TOLS[torch.bfloat16][1] for a, b in zip(g_c, g_e))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    print(f"\n[{label}] reduce-overhead: graphs={counters['stats']['unique_graphs']}, "
          f"cudagraph_skips={counters['inductor']['cudagraph_skips']}")  # fmt: skip
