"""Run FLA's Triton kernels on CPU tensors under ``TRITON_INTERPRET=1`` (tests only).

FLA's kernels do not run on CPU as shipped: the autotuner benchmarks configs through a GPU driver,
and some kernels call ``.to(...)`` on ``range`` loop counters, which the interpreter hands out as
Python ints. :func:`enable` patches both (autotuning picks the config with the largest blocks
without benchmarking; loop counters get a no-op ``.to``) and registers the ``fcp::fla_*`` ops'
own (FLA-calling) implementations as their CPU kernels. Tiny shapes only: a 64-token KDA forward
takes seconds.

Process-global and irreversible: call it first thing in a dedicated subprocess, before anything
imports ``triton`` or ``fla`` (the interpreter flag is read when kernels are decorated).
"""

from __future__ import annotations

import builtins
import math
import os
import sys

__all__ = ["enable"]


class _LoopIndex(int):
    """An int with the ``.to(dtype)`` that Triton tensors have (a no-op for the interpreter)."""

    def to(self, *args, **kwargs):
        return self


def _range(*args):
    for i in builtins.range(*(int(a) for a in args)):
        yield _LoopIndex(i)


def _gloo_all_gather_into_tensor(inp, out=None, group=None, async_op=False):
    """FLA's ``all_gather_into_tensor`` (output ``[world, *inp.shape]``) in gloo's concatenated
    form; gloo rejects the stacked output shape NCCL accepts."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group=group)
    flat = torch.empty(world * inp.shape[0], *inp.shape[1:], device=inp.device, dtype=inp.dtype)
    dist.all_gather_into_tensor(flat, inp.contiguous(), group=group)
    gathered = flat.view(world, *inp.shape)
    if out is not None:
        out.copy_(gathered)
        gathered = out
    return gathered, None


def enable(allow_cpu_cp: bool = False) -> None:
    """Patch Triton and FLA for the CPU interpreter and run the ``fcp::`` ops on FLA on CPU.

    ``allow_cpu_cp``: also lift FLA's "CP needs an NVIDIA GPU" device check, so FLA's own
    context-parallel path runs on CPU tensors over a gloo group (precision differs from the GPU's
    TF32x3 chains only by running in IEEE fp32).
    """
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("tests.support.fla_interpret.enable() must run before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.autotuner as autotuner

    def fake_bench(self, *args, config, **kwargs):
        size = math.prod(v for v in config.kwargs.values() if isinstance(v, int)) or 1
        return [1.0 / size] * 3  # "fastest" = largest blocks = fewest interpreted programs

    autotuner.Autotuner._bench = fake_bench

    import fla  # noqa: F401  (decorates every kernel, now in interpreter mode)
    import fla.modules.causal_conv1d.ops  # noqa: F401
    import fla.ops.kda.chunk_bwd  # noqa: F401
    import fla.ops.kda.chunk_fwd  # noqa: F401
    import fla.ops.simple_gla.chunk  # noqa: F401

    import fla.modules.causal_conv1d.cp  # noqa: F401
    import fla.ops.cp.chunk_delta_h  # noqa: F401

    for name, module in list(sys.modules.items()):
        if (name == "fla" or name.startswith("fla.")) and module is not None:
            module.__dict__["range"] = _range
            if allow_cpu_cp and "_check_cp_device" in module.__dict__:
                module.__dict__["_check_cp_device"] = lambda device: None
            if allow_cpu_cp and "all_gather_into_tensor" in module.__dict__:
                module.__dict__["all_gather_into_tensor"] = _gloo_all_gather_into_tensor

    import torch

    from fcp.ops.conv import fla as conv_fla
    from fcp.ops.gla import fla as gla_fla
    from fcp.ops.kda import fla as kda_fla

    for op in (kda_fla.fla_kda_fwd, kda_fla.fla_kda_bwd, kda_fla.fla_kda_varlen_fwd,
               kda_fla.fla_kda_varlen_bwd, conv_fla.fla_conv_varlen_fwd,
               conv_fla.fla_conv_varlen_bwd, gla_fla.fla_gla_fwd, gla_fla.fla_gla_bwd):  # fmt: skip
        torch.library.register_kernel(f"{op._namespace}::{op._name}", "cpu", op._init_fn)
