"""FLA interop on a CUDA device (``@pytest.mark.gpu``; skipped cleanly without CUDA).

Run by ``scripts/gpu_check.sh`` (``make gpu-check``). What is checked, against fcp's pure-PyTorch
operators run in fp32 on the same device (``fcp.ops.kda.kda`` / ``short_conv``):

* static mode (FLA dense kernel + gate resets) and FLA-varlen mode (FLA's ``cu_seqlens`` path),
  output and the gradients of q, k, v, g, beta, in bf16 and fp32, on rows packed with many short
  documents (several per 64-token chunk), long ones and a pad tail;
* the op's initial/final-state path with CP's ``[v | 0]`` / ``[0 | I]`` augmentation (``fcp::fla_kda_fwd`` with ``h0``) against the reference
  recurrence (the CP composition itself runs on CPU gloo ranks with the ops' CPU test doubles);
* FLA-varlen conv (``fcp::fla_conv_varlen_*``) against ``short_conv``;
* a CP-free ``torch.compile(mode="reduce-overhead")`` training step of a small conv + KDA block:
  CUDA graphs are captured (no cudagraph skips), replayed for three different packings without a
  recompile, and each step equals eager.

All FLA calls share one head layout (``H = HV = 16``, ``K = V = 128``, as the benchmark) so a cold
machine compiles few kernel variants; ``FCP_FLA_AUTOTUNE_MAX`` (set by ``scripts/gpu_check.sh``)
bounds Triton autotuning (:mod:`tests.support.triton_tuning`). GVA (``HV > H``) is covered on CPU.

Error metric: ``max |x - ref| / max |ref|`` per tensor. Tolerances: fp32 5e-3 for outputs and
1e-2 for gradients (FLA runs its fp32 matmuls in TF32 and keeps chunk states in the input dtype);
bf16 2e-2 / 4e-2. Static mode's own extra error (gate-reset rounding, ~1e-5) is far below both.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.conv import short_conv
from fcp.ops.conv.fla import short_conv_fla_varlen
from fcp.ops.kda import kda
from fcp.ops.kda.fla import fla_kda_fwd, kda_fla_static, kda_fla_varlen
from fcp.ops.kda.reference import kda_recurrence
from tests._fla_rank_fns import Block
from tests.support.gpu_checks import TOLS, assert_within, check_cuda_graph_replays, errors
from tests.support.gpu_checks import packed_rows
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err
from tests.support.triton_tuning import limit_from_env

pytestmark = pytest.mark.gpu

H, HV, DK, DV = 16, 16, 128, 128

if torch.cuda.is_available():
    limit_from_env()


def cuda_inputs(b, t, seed):
    """fp32 inputs on the device (cast to the tested dtype by ``errors``)."""
    return {n: x.cuda() for n, x in kda_inputs(b, t, H, HV, DK, DV, seed).items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["static", "varlen"])
def test_modes_match_pytorch(mode, dtype):
    doc = packed_rows(1024, seed=0).cuda()
    ctx = PackedContext(doc)
    inputs = cuda_inputs(2, doc.shape[1], seed=1)
    grad_out = torch.randn(2, doc.shape[1], HV, DV, device="cuda")
    fn = kda_fla_static if mode == "static" else kda_fla_varlen
    errs = errors(lambda *xs: fn(*xs, ctx), lambda *xs: kda(*xs, ctx), inputs, NAMES, dtype,
                  grad_out)  # fmt: skip
    print(f"\n[fla-gpu] {mode:7s} {str(dtype):15s} vs pure PyTorch: {errs}")
    assert_within(errs, dtype)


def test_op_initial_state_matches_recurrence():
    """The op with CP's augmentation ([v | 0], h0 = [0 | I]) against its PyTorch recurrence."""
    b, t = 1, 160
    inputs = cuda_inputs(b, t, seed=4)
    v_aug = torch.cat([inputs["v"], inputs["v"].new_zeros(b, t, HV, DK)], -1)
    eye = torch.eye(DK, device="cuda").expand(b, HV, DK, DK)
    h0 = torch.cat([eye.new_zeros(b, HV, DK, DV), eye], -1).contiguous()
    args = [inputs["q"], inputs["k"], v_aug, inputs["g"], inputs["beta"]]
    o, ht = fla_kda_fwd(*(a.to(torch.bfloat16) for a in args), h0, DK**-0.5, 64)[:2]
    o_ref, ht_ref = kda_recurrence(*args, DK**-0.5, initial_state=h0)
    errs = (rel_err(o, o_ref), rel_err(ht, ht_ref))
    print(f"\n[fla-gpu] op with h0 (bf16) vs recurrence (o, final state): {errs}")
    assert max(errs) <= TOLS[torch.bfloat16][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_varlen_matches_pytorch(dtype):
    doc = packed_rows(1024, seed=5).cuda()
    ctx = PackedContext(doc)
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(2, doc.shape[1], 256, device="cuda", generator=gen)
    w = torch.randn(256, 4, device="cuda", generator=gen) * 0.5
    bias = torch.randn(256, device="cuda", generator=gen)
    dy = torch.randn_like(x)
    res = {}
    for name, fn, dt in (("fla", short_conv_fla_varlen, dtype), ("ref", short_conv, torch.float32)):
        xs = [a.to(dt).clone().requires_grad_() for a in (x, w, bias)]
        y = fn(*xs, ctx, "silu")
        res[name] = [y.detach(), *torch.autograd.grad(y, xs, dy.to(y.dtype))]
    errs = [rel_err(a, r) for a, r in zip(res["fla"], res["ref"])]
    print(f"\n[fla-gpu] conv varlen {dtype} vs pure PyTorch (y, dx, dw, db): {errs}")
    assert max(errs) <= TOLS[dtype][0]


def test_reduce_overhead_cuda_graph_replays_new_packings():
    torch.manual_seed(0)
    model = Block(256, H, HV, DK, DV, width=4, mixer=kda, mixer_kw=[("backend", "fla")])
    check_cuda_graph_replays(model.cuda().to(torch.bfloat16), "fla-gpu")
