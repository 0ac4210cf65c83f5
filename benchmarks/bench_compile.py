"""Compile time of transformers' GLM-5.3-Flash and Qwen3.5 by depth: whole vs per layer kind.

    .venv/bin/python -m benchmarks.bench_compile                  # aot_eager (~15-20 minutes)
    .venv/bin/python -m benchmarks.bench_compile --backends aot_eager inductor --whole-depths 2 8 24

Each model is the family's tiny test configuration (``fcp.integrations.hf.families``: hidden 32)
at 2, 8 and 24 decoder layers, made with :func:`fcp.integrations.hf.enable_packed_cp`, on one
packed row of 64 tokens (two documents) on one rank (a CP size 1 context: compiling does not
depend on the CP size). Every depth has the same layer kinds, so that depth alone changes:
GLM-5.3-Flash alternates KDA and indexed MLA layers, all with the MoE (``mlp_layer_types``
"sparse"); Qwen3.5 alternates Gated DeltaNet and gated attention (2 kinds each; transformers'
default patterns put 1 or 3 kinds into 2 layers and 2 or 3 into 24). Two ways to compile:

* ``whole``: ``model.compile(backend=...)`` (one graph of every layer);
* ``regional``: :func:`fcp.integrations.hf.compile_layers` (each decoder layer on its own: layers
  of one kind share one graph).

Compile time: the first forward + backward step's CPU time (this process and the compiler
processes it waited for) minus the median of 3 later steps: what the first step paid to compile
(CPU time: the machine is shared; wall times are in the returned records). Every measurement
runs in a fresh process with an empty inductor cache directory, so nothing compiled before is
reused; ``dynamic=False``, 1 thread. ``steady s``: the CPU seconds of a later step at the
deepest depth measured.
Target (issue 31): regional, 24 layers within 1.5x of 2 layers.

Inductor is opt-in (``--backends aot_eager inductor``): one regional inductor measurement of 2
GLM-5.3-Flash layers took 257 CPU seconds (532 s wall on the shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAMILIES = {"glm5_next": "GLM-5.3-Flash", "qwen3_5": "Qwen3.5"}
#: the second layer kind of each family (the first: "linear_attention")
_ATTENTION = {"glm5_next": "indexed_attention", "qwen3_5": "full_attention"}
SEQ = 64


def build(family: str, depth: int):
    """The family's tiny text model on fcp, ``depth`` layers alternating its two layer kinds."""
    import importlib
    import copy

    import torch

    from fcp.integrations.hf import enable_packed_cp
    from fcp.integrations.hf.families import family as row

    config = copy.deepcopy(dict(row(family).test_config))
    config.update(num_hidden_layers=depth,
                  layer_types=[("linear_attention", _ATTENTION[family])[i % 2]
                               for i in range(depth)])  # fmt: skip
    if family == "glm5_next":
        config["mlp_layer_types"] = ["sparse"] * depth
    models = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(models, row(family).text_model)
    torch.manual_seed(0)
    cfg = cls.config_class(**config)
    cfg._attn_implementation = "eager"
    return enable_packed_cp(cls(cfg)).train()


def measure(family: str, depth: int, backend: str, mode: str, repeats: int = 3) -> dict:
    """One measurement in this process (``--one``): compile seconds, steady step seconds, the
    compiled frames and the layer kinds."""
    import torch
    import torch._dynamo.testing

    import fcp
    from fcp.integrations.hf import compile_layers, layer_kinds

    torch.set_num_threads(1)
    model = build(family, depth)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    if mode == "whole":
        model.compile(backend=counter, dynamic=False)
    else:
        compile_layers(model, backend=counter, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 128, (1, SEQ), generator=gen),
             "seq_lens": torch.tensor([[SEQ - 24, 24]])}  # fmt: skip
    local, ctx = fcp.shard_batch(None, batch)
    walls, cpus = [], []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), _cpu()
        out = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        out.last_hidden_state.square().mean().backward()
        walls.append(time.perf_counter() - t0)
        cpus.append(_cpu() - c0)
    steady, steady_cpu = statistics.median(walls[1:]), statistics.median(cpus[1:])
    return dict(compile=cpus[0] - steady_cpu, steady=steady_cpu, compile_wall=walls[0] - steady,
                steady_wall=steady, frames=counter.frame_count,
                kinds=len(layer_kinds(model.layers)))  # fmt: skip


def _cpu() -> float:
    """CPU seconds of this process and its finished children (inductor's C++ compiler runs): on
    a shared machine steadier than wall time."""
    import resource

    own, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))  # fmt: skip
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _spawn(family: str, depth: int, backend: str, mode: str, timeout: float) -> dict | None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=cache,
                   TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
                   TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")  # fmt: skip
        cmd = [sys.executable, "-m", "benchmarks.bench_compile", "--one", family, str(depth),
               backend, mode]  # fmt: skip
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> dict:
    from benchmarks.common import Table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--depths", type=int, nargs="+", default=[2, 8, 24])
    p.add_argument("--backends", nargs="+", default=["aot_eager"],
                   help="add inductor for its compile times (~10 CPU minutes per measurement)")
    p.add_argument("--whole-depths", type=int, nargs="*", default=[2, 8],
                   help="depths to compile whole too (24 whole layers take many minutes)")
    p.add_argument("--whole-backends", nargs="*", default=["aot_eager"])
    p.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
    p.add_argument("--one", nargs=4, metavar=("FAMILY", "DEPTH", "BACKEND", "MODE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        family, depth, backend, mode = args.one
        print(json.dumps(measure(family, int(depth), backend, mode)))
        return {}

    print(f"# compile CPU seconds (first fwd+bwd minus a steady one) of tiny transformers "
          f"models on fcp, {SEQ} tokens, 1 rank, dynamic=False; frames compiled; every depth "
          "has 2 layer kinds")
    table = Table(("model", ">13"), ("backend", ">9"), ("mode", ">8"),
                  *((f"{d} layers", ">16") for d in args.depths), (f"{args.depths[-1]}/"
                  f"{args.depths[0]}", ">7"), ("steady s", ">8"))  # fmt: skip
    table.header()
    res = {}
    for family in args.families:
        for backend in args.backends:
            for mode in ("regional", "whole"):
                if mode == "whole" and backend not in args.whole_backends:
                    continue
                depths = [d for d in args.depths if mode == "regional" or d in args.whole_depths]
                row = {d: _spawn(family, d, backend, mode, args.timeout) for d in depths}
                res[(family, backend, mode)] = row
                cells = [(f"{row[d]['compile']:6.1f} s / {row[d]['frames']}" if row.get(d)
                          else "timeout" if d in row else "-") for d in args.depths]  # fmt: skip
                first, last = row.get(args.depths[0]), row.get(args.depths[-1])
                ratio = f"{last['compile'] / first['compile']:.2f}x" if first and last else "-"
                steady = row.get(args.depths[-1]) or row.get(depths[-1])
                table.row(FAMILIES[family], backend, mode, *cells, ratio,
                          f"{steady['steady']:.2f}" if steady else "-")  # fmt: skip
    print(f"\ntarget: regional {args.depths[-1]} layers within 1.5x of {args.depths[0]} layers "
          "(the compile grows with the layer kinds, not the depth)")
    return res


if __name__ == "__main__":
    main()
