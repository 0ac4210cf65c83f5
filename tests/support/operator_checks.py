"""Checks every packed recurrent operator must pass (``fcp.ops.kda.kda``, ``fcp.ops.gla.gla``):
oracle comparisons, document independence, inert padding, one compilation across packings.

An operator is called ``op(*inputs, ctx, **kwargs)`` with its inputs in the order ``names``
(``("q", "k", "v", "g", "beta")`` for KDA, ``("q", "k", "v", "a")`` for GLA); a function under
comparison takes the inputs positionally, ``fn(*inputs)``, and returns the output::

    ctx = PackedContext(doc_ids)
    check(lambda *xs: gla(*xs, ctx),                                     # the operator
          lambda *xs: per_document(loop_gla_doc, xs, doc_ids, 0.25),     # an oracle per document
          inputs, grad_out, 1e-5, names=("q", "k", "v", "a"))

Error metric: :func:`tests.support.inputs.rel_err` (``max |x - ref| / max |ref|``) per tensor.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from tests.support.cp_jobs import GraphRecorder
from tests.support.inputs import rel_err
from tests.support.packing import doc_ids_from_lengths, ref_segments


def per_document(doc_fn, xs, doc_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """``doc_fn(*inputs, scale)`` run on every run (document or pad tail) of every row of the
    inputs ``xs`` (a sequence of ``[B, L, ...]`` tensors), concatenated back; fp64,
    differentiable."""
    rows = []
    for b in range(doc_ids.shape[0]):
        bounds = ref_segments(doc_ids[b].tolist())
        rows.append(torch.cat([doc_fn(*(x[b, s:e] for x in xs), scale).double()
                               for s, e in zip(bounds[:-1], bounds[1:])]))  # fmt: skip
    return torch.stack(rows)


def out_and_grads(fn, inputs: dict, grad_out: torch.Tensor, names):
    """``(out, {name: gradient})`` of ``fn(*inputs in names order)`` for ``sum(out * grad_out)``."""
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = fn(*(xs[n] for n in names))
    grads = torch.autograd.grad(out, [xs[n] for n in names], grad_out.to(out.dtype))
    return out.detach(), dict(zip(names, grads))


def check(fn_a, fn_b, inputs, grad_out, tol, names) -> dict:
    """Output and every input gradient of ``fn_a`` finite and within ``tol`` (rel) of
    ``fn_b``'s; returns the errors."""
    out_a, grads_a = out_and_grads(fn_a, inputs, grad_out, names)
    out_b, grads_b = out_and_grads(fn_b, inputs, grad_out, names)
    errs = {"out": rel_err(out_a, out_b), **{n: rel_err(grads_a[n], grads_b[n]) for n in names}}
    assert all(torch.isfinite(x).all() for x in [out_a, *grads_a.values()])
    assert max(errs.values()) <= tol, errs
    return errs


#: per-token log decays that stress the chunked form: -8 (over a 64-token chunk -512: a naive
#: ``exp(-cumsum)`` overflows fp32), 0 (no decay), a mix of both, and an extreme -40
EXTREME_DECAYS = ("-8", "0", "mixed", "-40")


def with_decay(inputs: dict, name: str, decay: str) -> dict:
    """``inputs`` with the log decays ``inputs[name]`` all set to ``decay`` (one of
    :data:`EXTREME_DECAYS`; ``"mixed"``: -8 or 0 per entry, evenly at random)."""
    like = inputs[name]
    if decay == "mixed":
        pick = torch.rand(like.shape, generator=torch.Generator().manual_seed(0)) < 0.5
        return dict(inputs, **{name: torch.where(pick, -8.0, 0.0)})
    return dict(inputs, **{name: torch.full_like(like, float(decay))})


def check_documents_independent(op, inputs_of, names, **kwargs) -> None:
    """On one row of short, single-token and long documents and a pad tail (64 tokens),
    replacing one document's inputs ``inputs_of(64, seed=5)`` by ``3 * inputs_of(64, seed=6)``
    changes that document's output and leaves every other position bitwise unchanged, for every
    document and the pad tail."""
    doc_ids = doc_ids_from_lengths([([5, 1, 20, 1, 30, 3], 4)])
    inputs, noise = inputs_of(64, seed=5), inputs_of(64, seed=6)
    ctx = PackedContext(doc_ids)
    base = op(*(inputs[n] for n in names), ctx, **kwargs)
    for d in doc_ids.unique().tolist():
        inside = doc_ids[0] == d
        pert = {n: torch.where(inside.view(1, -1, *([1] * (x.dim() - 2))), 3 * noise[n], x)
                for n, x in inputs.items()}  # fmt: skip
        out = op(*(pert[n] for n in names), ctx, **kwargs)
        assert torch.equal(out[:, ~inside], base[:, ~inside]), d
        assert not torch.equal(out[:, inside], base[:, inside]), d


def check_pad_inert(op, inputs: dict, names, **kwargs) -> None:
    """On one row of two documents (10, 13 tokens) and a 9-token pad tail (``inputs`` of 32
    tokens), with garbage (1e4) in the pad tail's values: the output stays finite, and the pad
    tail's outputs send no gradient to any real token."""
    doc_ids = doc_ids_from_lengths([([10, 13], 9)])
    real = 23
    inputs = dict(inputs, v=inputs["v"].clone())
    inputs["v"][:, real:] = 1e4
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = op(*(xs[n] for n in names), PackedContext(doc_ids), **kwargs)
    assert torch.isfinite(out).all()
    out[:, real:].sum().backward()
    for n in names:
        assert torch.equal(xs[n].grad[:, :real], torch.zeros_like(xs[n].grad[:, :real])), n


def check_compiled_once(op, cases, names, **kwargs) -> None:
    """``op`` under ``torch.compile(fullgraph=True)`` (aot_eager's parts) equals eager to 1e-6
    (output and input gradients) on every ``(doc_ids, inputs, grad_out)`` of ``cases``, compiles
    one frame for all of them, and its graphs hold no host synchronisation."""
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(op, fullgraph=True, backend=recorder)
    for doc_ids, inputs, grad_out in cases:
        ctx = PackedContext(doc_ids)

        def run(fn):
            return out_and_grads(lambda *xs: fn(*xs, ctx, **kwargs), inputs, grad_out, names)

        out_c, grads_c = run(compiled)
        out_e, grads_e = run(op)
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in names)
    assert recorder.frames == 1, recorder.frames
    assert recorder.host_syncs() == [], recorder.host_syncs()
    # the recorder saw the real aten graphs (KDA's matmuls are inside its custom op)
    assert any(o.startswith("aten.") for o in recorder.ops), recorder.ops


def check_compiled_block_gradient(block, x: torch.Tensor, w: torch.Tensor) -> None:
    """``block(x, w)`` (a layer that projects, splits and views its inputs before the operator)
    compiled with aot_eager, fullgraph: the gradient of ``w`` equals eager's."""
    grads = []
    for fn in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        w.grad = None
        fn(x, w).pow(2).sum().backward()
        grads.append(w.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
