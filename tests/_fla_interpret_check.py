"""FLA's real Triton kernels on CPU (``TRITON_INTERPRET=1``) against fcp's references.

Run as a subprocess by ``tests/test_fla.py::test_fla_kernels_under_triton_interpreter``:
``python -m tests._fla_interpret_check`` prints one JSON object ``{check: {metric: value}}`` on its
last line. Nothing here may run in the pytest process (the interpreter patches are global).

Checks (fp32, tiny shapes; each value is max |a - ref| / max |ref|):

* ``static``: :func:`fla_kda_static` (FLA dense kernel, gate resets) vs :func:`kda_reference`,
  output and the five input gradients, on rows with several documents inside one chunk,
  one-token documents and a pad tail.
* ``h0``: ``fcp::fla_kda_fwd`` with the CP-augmented initial state ``[0 | I]`` and ``[v | 0]``
  (what static mode runs under CP) vs the op's PyTorch recurrence: output, final state, grads
  (including through the final state).
* ``varlen``: :func:`fla_kda_varlen` (FLA's cu_seqlens path, no CP) vs :func:`kda_reference`.
* ``conv``: :func:`fla_short_conv_varlen` (FLA's causal_conv1d, cu_seqlens) vs
  :func:`short_conv_reference`, output and x/weight/bias gradients.
"""

from __future__ import annotations

import json
import time

from tests.support import fla_interpret

fla_interpret.enable()

import torch  # noqa: E402

from fcp.context import PackedContext  # noqa: E402
from fcp.ops.conv.reference import short_conv_reference  # noqa: E402
from fcp.ops.conv.fla import short_conv_fla_varlen  # noqa: E402
from fcp.ops.kda.fla import fla_kda_fwd, kda_fla_static, kda_fla_varlen  # noqa: E402
from fcp.ops.kda.reference import kda_recurrence, kda_reference  # noqa: E402
from tests._fla_rank_fns import doc_ids_from_lengths, make_inputs, rel_err  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def _grads(fn, inputs: dict, grad_out: torch.Tensor):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = fn(*(xs[n] for n in NAMES))
    (out.double() * grad_out).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def _compare(fn, ref_fn, inputs, seed) -> dict:
    out_shape = (*inputs["v"].shape,)
    grad_out = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out, grads = _grads(fn, inputs, grad_out)
    ref, ref_grads = _grads(ref_fn, inputs, grad_out)
    res = {"out": rel_err(out, ref)}
    res.update({f"d{n}": rel_err(grads[n], ref_grads[n]) for n in NAMES})
    return res


def check_static() -> dict:
    # row 0: 1-token docs, two resets inside the first 32-chunk, a doc across chunks, pad tail
    doc = doc_ids_from_lengths([([1, 1, 3, 20, 30, 1], 8)])
    ctx = PackedContext(doc)
    inputs = make_inputs(1, doc.shape[1], 1, 2, 16, 16, seed=1)
    return _compare(
        lambda *xs: kda_fla_static(*xs, ctx, chunk_size=32),
        lambda *xs: kda_reference(*xs, ctx),
        inputs,
        seed=2,
    )


def check_h0() -> dict:
    b, t, h, hv, dk, dv = 1, 40, 1, 2, 16, 8
    inputs = make_inputs(b, t, h, hv, dk, dv, seed=3)
    v_aug = torch.cat([inputs["v"], inputs["v"].new_zeros(b, t, hv, dk)], -1)
    eye = torch.eye(dk).expand(b, hv, dk, dk)
    h0 = torch.cat([torch.zeros(b, hv, dk, dv), eye], -1).contiguous()
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(b, t, hv, dv + dk, generator=gen)
    dht = torch.randn(b, hv, dk, dv + dk, generator=gen)
    res = {}
    outs = {}
    for name in ("fla", "torch"):
        xs = [x.clone().requires_grad_() for x in (inputs["q"], inputs["k"], v_aug, inputs["g"], inputs["beta"])]
        if name == "fla":
            o, ht = fla_kda_fwd(*xs, h0, 0.25, 32)[:2]
        else:
            o, ht = kda_recurrence(*xs, 0.25, initial_state=h0)
        ((o * do).sum() + (ht * dht).sum()).backward()
        outs[name] = [o.detach(), ht.detach()] + [x.grad for x in xs]
    for i, key in enumerate(("out", "final_state", "dq", "dk", "dv", "dg", "dbeta")):
        res[key] = rel_err(outs["fla"][i], outs["torch"][i])
    return res


def check_varlen() -> dict:
    doc = doc_ids_from_lengths([([2, 1, 30, 7], 0)])
    ctx = PackedContext(doc)
    inputs = make_inputs(1, doc.shape[1], 1, 1, 16, 16, seed=5)
    return _compare(
        lambda *xs: kda_fla_varlen(*xs, ctx, chunk_size=32),
        lambda *xs: kda_reference(*xs, ctx),
        inputs,
        seed=6,
    )


def check_conv() -> dict:
    doc = doc_ids_from_lengths([([1, 2, 30, 5], 2), ([40], 0)])
    ctx = PackedContext(doc)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 40, 24, generator=gen)
    w = torch.randn(24, 4, generator=gen)
    bias = torch.randn(24, generator=gen)
    dy = torch.randn(2, 40, 24, generator=gen)
    res = {}
    got = {}
    for name, fn in (
        ("fla", lambda x, w, b: short_conv_fla_varlen(x, w, b, ctx, "silu")),
        ("ref", lambda x, w, b: short_conv_reference(x, w, b, doc, "silu")),
    ):
        xs = [t.clone().requires_grad_() for t in (x, w, bias)]
        y = fn(*xs)
        (y * dy).sum().backward()
        got[name] = [y.detach()] + [t.grad for t in xs]
    for i, key in enumerate(("out", "dx", "dweight", "dbias")):
        res[key] = rel_err(got["fla"][i], got["ref"][i])
    return res


def main() -> None:
    report = {}
    for name, fn in (("static", check_static), ("h0", check_h0), ("varlen", check_varlen),
                     ("conv", check_conv)):  # fmt: skip
        t0 = time.perf_counter()
        report[name] = fn()
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
