"""fcp.gla on a CUDA device (``@pytest.mark.gpu``; skipped cleanly without CUDA).

Run by ``scripts/gpu_check.sh`` (``make gpu-check``) with the other ``gpu`` tests. What is
checked, on rows packed with many short documents (several per 64-token chunk), long ones and a
pad tail, at Mamba2-like head shapes (2 groups, 8 heads, K = d_state = 128, V = head_dim = 64):

* the ``"fla"`` backend (FLA's ``simple_gla`` chunk kernels as ``fcp::fla_gla_*`` ops, decay
  resets) in bf16 and fp32 against the exact ``"chunked"`` backend run in fp32 on the same
  device: output and the gradients of q, k, v, a;
* the ``"chunked"`` backend on CUDA against the per-token reference (fp32, small);
* the per-key ``"fla"`` backend (``a [B, L, H, K]``, FLA's ``chunk_gla`` kernels) against the
  ``"chunked"`` backend, bf16 and fp32;
* a ``torch.compile(mode="reduce-overhead")`` training step of a small Mamba2-like block on the
  ``"fla"`` backend: CUDA graphs captured once, replayed for three packings without recompiling,
  each step equal to eager.

The CP composition around the op runs on CPU gloo ranks with the ops' CPU test doubles
(``tests/test_gla_fla.py``). Error metric: ``max |x - ref| / max |ref|`` per tensor.
Tolerances as for KDA's FLA backend: fp32 5e-3 (outputs) / 1e-2 (gradients), because FLA runs
its fp32 matmuls in TF32 and keeps chunk states in the input dtype; bf16 2e-2 / 4e-2.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.gla import gla
from fcp.ops.gla.reference import gla_reference
from tests._gla_rank_fns import NAMES, make_inputs
from tests.support.gpu_checks import assert_within, check_cuda_graph_replays, errors
from tests.support.gpu_checks import out_and_grads, packed_rows
from tests.support.inputs import rel_err
from tests.support.packing import doc_ids_from_lengths
from tests.support.triton_tuning import limit_from_env

pytestmark = pytest.mark.gpu

G, H, K, V = 2, 8, 128, 64

if torch.cuda.is_available():
    limit_from_env()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_backend_matches_chunked(dtype):
    doc = packed_rows(1024, seed=0).cuda()
    ctx = PackedContext(doc)
    inputs = {n: x.cuda() for n, x in make_inputs(2, 1024, G, H, K, V, seed=1).items()}
    grad_out = torch.randn(2, 1024, H, V, device="cuda")
    errs = errors(lambda *xs: gla(*xs, ctx, backend="fla"), lambda *xs: gla(*xs, ctx), inputs,
                  NAMES, dtype, grad_out)  # fmt: skip
    print(f"\n[gla-gpu] fla {dtype} vs chunked fp32: {errs}")
    assert_within(errs, dtype)


def test_chunked_on_cuda_matches_reference():
    doc = doc_ids_from_lengths([([3, 50, 1, 20], 6)]).cuda()
    ctx = PackedContext(doc)
    inputs = {n: x.cuda() for n, x in make_inputs(1, 80, 1, 2, 16, 8, seed=2).items()}
    grad_out = torch.randn(1, 80, 2, 8, device="cuda")
    out, grads = out_and_grads(lambda *xs: gla(*xs, ctx, chunk_size=16), inputs, NAMES,
                               torch.float32, grad_out)  # fmt: skip
    ref, ref_grads = out_and_grads(lambda *xs: gla_reference(*xs, ctx), inputs, NAMES,
                                   torch.float64, grad_out)  # fmt: skip
    errs = [rel_err(out, ref)] + [rel_err(grads[n], ref_grads[n]) for n in NAMES]
    assert max(errs) <= 1e-4, errs  # fp32 on the GPU (TF32 off by default for matmuls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_backend_with_a_decay_per_key_matches_chunked(dtype):
    """The per-key ``"fla"`` backend (FLA's ``chunk_gla`` kernels, decay resets) against the
    exact ``"chunked"`` backend in fp32 on the same device, GLA-like heads (K = V = 64)."""
    from tests._gla_rank_fns import make_keyed_inputs

    doc = packed_rows(512, seed=3).cuda()
    ctx = PackedContext(doc)
    inputs = {n: x.cuda() for n, x in make_keyed_inputs(2, 512, 2, 4, 64, 64, seed=4).items()}
    grad_out = torch.randn(2, 512, 4, 64, device="cuda")
    errs = errors(lambda *xs: gla(*xs, ctx, backend="fla"), lambda *xs: gla(*xs, ctx), inputs,
                  NAMES, dtype, grad_out)  # fmt: skip
    print(f"\n[gla-gpu] keyed fla {dtype} vs chunked fp32: {errs}")
    assert_within(errs, dtype)


class Mamba2Like(torch.nn.Module):
    """in_proj -> (C, B, x, dt); dt softplus; fcp.gla on the "fla" backend; D skip; out_proj."""

    def __init__(self, d=256):
        super().__init__()
        self.proj = torch.nn.Linear(d, 2 * G * K + H * V + H, bias=False)
        self.a_log = torch.nn.Parameter(torch.log(torch.arange(1.0, H + 1)))
        self.d = torch.nn.Parameter(torch.ones(H))
        self.out = torch.nn.Linear(H * V, d, bias=False)

    def forward(self, x, context):
        b, t, _ = x.shape
        c_, b_, v_, dt = self.proj(x).split([G * K, G * K, H * V, H], -1)
        dt = torch.nn.functional.softplus(dt.float() - 3.0)
        v_ = v_.reshape(b, t, H, V)
        y = gla(c_.reshape(b, t, G, K), b_.reshape(b, t, G, K), v_ * dt[..., None].to(v_.dtype),
                dt * -self.a_log.exp(), context, scale=1.0, backend="fla")  # fmt: skip
        return self.out((y + self.d[:, None].to(y.dtype) * v_).reshape(b, t, -1))


def test_reduce_overhead_cuda_graph_replays_new_packings():
    torch.manual_seed(0)
    check_cuda_graph_replays(Mamba2Like().cuda().to(torch.bfloat16), "gla-gpu")
