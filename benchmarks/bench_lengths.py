"""Row lengths that change: compile cost of the demo GLM-5.3-Flash's mixers, static vs dynamic.

    .venv/bin/python -m benchmarks.bench_lengths [--lengths 512 576 640 768] [--world 1]
        [--repeats 3] [--variants static auto dynamic dynamic_sf static* dynamic*]
        [--backend aot_eager|inductor] [--modules mixers transformers]

The demo compiles every fcp-backed token mixer (``mixer.compile(fullgraph=True,
backend="aot_eager")``, or ``--backend inductor``). Each variant starts from a fresh Dynamo
state and a fresh model and runs forward + backward on one packed row of each length in turn
(``fcp.shard_batch``'s default arguments: local lengths need not be multiples of KDA's chunk):

* ``static`` (``dynamic=False``): every new length compiles new graphs;
* ``auto`` (Dynamo's default): the first length compiles static graphs, the second recompiles
  them once with a dynamic sequence dimension, later lengths reuse it;
* ``dynamic`` (``dynamic=True``): one dynamic compile at the first length;
* ``dynamic_sf``: the same with ``torch._dynamo.config.specialize_float = True`` (scoped to the
  run). Under ``dynamic=True`` Dynamo turns every float attribute of a module into a graph
  input, and restarts the trace of the whole frame when one reaches an op that needs a Python
  float: fcp's operators take their scales as tensors
  (:func:`fcp.ops.kit.common.scalar_tensor`), but the DSA indexer's ``nn.LayerNorm`` passes its
  ``eps`` to ``aten.layer_norm``. With floats specialised (what PyTorch does anyway under CUDA
  graphs) there is no restart: the difference is that restart's cost;
* ``static*`` and ``dynamic*``: the same with Dynamo's fake-tensor cache off
  (``torch._dynamo.config.fake_tensor_cache_enabled = False``, scoped to the run): with a
  symbolic length, rebuilding each cached op's output from its cache entry re-derives its
  symbolic sizes and strides, and costs more than running the meta kernel again.

``--modules`` (default both, one after the other in one run): ``mixers``, the fcp mixers above;
``transformers``, the reference: the modules of the same layers that fcp does not touch (each
layer's MLP or MoE, RMSNorms and hyper-connections: transformers' own code, compiled module by
module the same way), i.e. PyTorch's own price of a symbolic length on this machine. The last
line divides the mixers' ratios by the reference's.

Reported per variant and length: the step's wall time minus the same step's steady-state time
(the compile cost it paid), and the compiled frames so far; per variant the Dynamo restarts
(attempts that did not produce a graph). The ratios divide each dynamic compile by the median
static compile. Target: the dynamic compile at most 2x the static one.
1 thread per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fcp
from benchmarks.bench_glm5_cp import train_step
from benchmarks.common import Table
from examples.data import PackedDocuments
from examples.glm5_hf import Glm5NextLM
from tests.support.rank_pool import RankPool

#: name -> (``dynamic=``, fake-tensor cache on, floats specialised)
VARIANTS = {"static": (False, True, False), "auto": (None, True, False),
            "dynamic": (True, True, False), "dynamic_sf": (True, True, True),
            "static*": (False, False, False), "dynamic*": (True, False, False)}


def reference_modules(model) -> list[torch.nn.Module]:
    """The modules of ``model``'s layers other than the token mixers: transformers' code alone."""
    return [m for layer in model.blocks for name, m in layer.named_children()
            if name != "self_attn"]


def job(env, lengths: list[int], variant: str, repeats: int, backend: str = "aot_eager",
        modules: str = "mixers") -> dict:
    torch.set_num_threads(1)
    import contextlib

    from torch._inductor.utils import fresh_cache

    dynamic, cache, floats = VARIANTS[variant]
    # inductor: an empty kernel cache per variant (a later variant would reuse an earlier
    # one's compiled graphs and kernels, from disk and from memory)
    fresh = fresh_cache() if backend == "inductor" else contextlib.nullcontext()
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=cache, specialize_float=floats), \
            fresh:  # fmt: skip
        return _run(env, lengths, dynamic, repeats, backend, modules)


def _run(env, lengths: list[int], dynamic: bool | None, repeats: int, backend: str,
         modules: str) -> dict:
    import torch._dynamo.testing

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    model = Glm5NextLM.from_config()
    for module in model.mixers() if modules == "mixers" else reference_modules(model):
        module.compile(fullgraph=True, backend=counter, dynamic=dynamic)
    group = env.group if env.world_size > 1 else None
    first, steady, frames = [], [], []
    for seq in lengths:
        batch = PackedDocuments(seq, 1, seed=seq).batches(1)[0]
        local, ctx = fcp.shard_batch(group, batch)
        times = []
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            train_step(model, local, ctx)
            times.append(time.perf_counter() - t0)
        first.append(times[0])
        steady.append(statistics.median(times[1:]))
        frames.append(counter.frame_count)
    attempts = torch._dynamo.utils.counters["aot_autograd"]
    return {"compile": [f - s for f, s in zip(first, steady)], "steady": steady,
            "frames": frames, "restarts": attempts["total"] - attempts["ok"]}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 576, 640, 768])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="a subset to run (the ratios need static and dynamic)")
    p.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager")
    p.add_argument("--modules", nargs="+", choices=("mixers", "transformers"),
                   default=["mixers", "transformers"],
                   help="what to compile: the fcp mixers, and the layers' other modules "
                        "(transformers' own code: the reference)")  # fmt: skip
    args = p.parse_args(argv)
    runs = {}
    with RankPool(max_world_size=max(2, args.world), timeout=600, job_timeout=3600) as pool:
        for modules in args.modules:
            runs[modules] = _variants(pool, args, modules)
    # the mixers' results at the top level (the report reads them there), the reference beside
    res = dict(runs.get("mixers", {}))
    if "transformers" in runs:
        res["transformers"] = runs["transformers"]
    if {"mixers", "transformers"} <= runs.keys():
        mine, ref = runs["mixers"]["ratios"], runs["transformers"]["ratios"]
        res["over_reference"] = {k: mine[k] / ref[k] for k in mine
                                 if k.endswith("_over_static") and ref.get(k)}  # fmt: skip
        print("\nmixers' ratios / transformers' own: "
              + "; ".join(f"{k}: {v:.2f}" for k, v in res["over_reference"].items()))
    return res


def _variants(pool, args, modules: str) -> dict:
    what = {"mixers": "mixers (fcp)", "transformers": "other modules (transformers' own code)"}
    print(f"\n# demo GLM-5.3-Flash {what[modules]} compiled ({args.backend}), {args.world} "
          f"rank(s), rows of {args.lengths} tokens: compile seconds paid at each length / "
          "compiled frames")  # fmt: skip
    table = Table(("variant", ">10"), *((f"{n} tok", ">14") for n in args.lengths),
                  ("steady s", "9.3f"), ("restarts", ">8"))  # fmt: skip
    table.header()
    res = {}
    for variant in args.variants:
        ranks = pool.run(job, args.world, args.lengths, variant, args.repeats, args.backend,
                         modules)  # fmt: skip
        r = {"compile": [max(x["compile"][i] for x in ranks) for i in range(len(args.lengths))],
             "steady": statistics.median(ranks[0]["steady"]), "frames": ranks[0]["frames"],
             "restarts": ranks[0]["restarts"]}  # fmt: skip
        res[variant] = r
        table.row(variant, *(f"{c:6.2f} s / {f}" for c, f in zip(r["compile"], r["frames"])),
                  r["steady"], str(r["restarts"]))  # fmt: skip
    res["ratios"] = q = _ratios(res)
    print("; ".join(f"{k}: {v:.2f}" for k, v in q.items()) + " (target: dynamic_over_static <= 2)")
    return res


def _ratios(res: dict) -> dict:
    """The ratios the variants that ran allow: each dynamic compile (``compile[0]``, or auto's
    recompile ``compile[1]``) against a static compile, the median over the lengths of the
    static variant (the same kind of run: its first length also pays the process's one-time
    imports, which a later variant does not)."""
    q = {}

    def static(v: str) -> float:
        return statistics.median(res[v]["compile"])

    if {"static", "dynamic"} <= res.keys():
        q["dynamic_over_static"] = res["dynamic"]["compile"][0] / static("static")
    if {"static", "dynamic_sf"} <= res.keys():
        q["dynamic_sf_over_static"] = res["dynamic_sf"]["compile"][0] / static("static")
    if {"static", "dynamic*"} <= res.keys():
        q["dynamic_nocache_over_static"] = res["dynamic*"]["compile"][0] / static("static")
    if {"static*", "dynamic*"} <= res.keys():
        q["dynamic_nocache_over_static_nocache"] = (res["dynamic*"]["compile"][0]
                                                    / static("static*"))  # fmt: skip
    if {"static", "auto"} <= res.keys() and len(res["auto"]["compile"]) > 1:
        q["auto_recompile_over_static"] = res["auto"]["compile"][1] / static("static")
    for v in ("auto", "static"):
        if v in res:
            q[f"{v}_recompiles"] = res[v]["frames"][-1] // res[v]["frames"][0] - 1
    return q


if __name__ == "__main__":
    main()
