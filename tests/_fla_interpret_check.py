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
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err  # noqa: E402
from tests.support.kda_oracles import out_and_grads  # noqa: E402
from tests.support.packing import doc_ids_from_lengths  # noqa: E402


def _check_mode(mode, rows, value_heads, seed) -> dict:
    """``mode`` (through FLA's kernels) vs :func:`kda_reference`: output and input gradients."""
    doc = doc_ids_from_lengths(rows)
    ctx = PackedContext(doc)
    inputs = kda_inputs(1, doc.shape[1], 1, value_heads, 16, 16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(*inputs["v"].shape, generator=gen, dtype=torch.float64)
    out, grads = out_and_grads(lambda *xs: mode(*xs, ctx, chunk_size=32), inputs, grad_out)
    ref, ref_grads = out_and_grads(lambda *xs: kda_reference(*xs, ctx), inputs, grad_out)
    return {"out": rel_err(out, ref)} | {f"d{n}": rel_err(grads[n], ref_grads[n]) for n in NAMES}


def check_static() -> dict:
    # row 0: 1-token docs, two resets inside the first 32-chunk, a doc across chunks, pad tail
    return _check_mode(kda_fla_static, [([1, 1, 3, 20, 30, 1], 8)], 2, seed=1)


def check_h0() -> dict:
    b, t, h, hv, dk, dv = 1, 40, 1, 2, 16, 8
    inputs = kda_inputs(b, t, h, hv, dk, dv, seed=3)
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
    return _check_mode(kda_fla_varlen, [([2, 1, 30, 7], 0)], 1, seed=5)


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
