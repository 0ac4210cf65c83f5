"""Row lengths that change: compile cost of the demo GLM-5.3-Flash's token mixers, static vs dynamic.

    .venv/bin/python -m benchmarks.bench_lengths [--lengths 512 576 640 768] [--world 1]

The demo compiles every fcp-backed token mixer (``mixer.compile(fullgraph=True,
backend="aot_eager")``). Each variant starts from a fresh Dynamo state and a fresh model and runs
forward + backward on one packed row of each length in turn (``fcp.shard_batch(...,
pad_multiple=64)``: local lengths a multiple of KDA's chunk, the policy the README recommends
for dynamic lengths):

* ``static`` (``dynamic=False``): every new length compiles new graphs;
* ``auto`` (Dynamo's default): the first length compiles static graphs, the second recompiles
  them once with a dynamic sequence dimension, later lengths reuse it;
* ``dynamic`` (``dynamic=True``): one dynamic compile at the first length;
* ``static*`` and ``dynamic*``: the same with Dynamo's fake-tensor cache off
  (``torch._dynamo.config.fake_tensor_cache_enabled = False``, scoped to the run): with a
  symbolic length, rebuilding each cached op's output from its cache entry re-derives its
  symbolic sizes and strides, and costs more than running the meta kernel again.

Reported per variant and length: the step's wall time minus the same step's steady-state time
(the compile cost it paid), and the compiled frames so far. Target: the dynamic compile at most
2x the static one. 1 thread per rank.
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

#: name -> (``dynamic=``, fake-tensor cache on)
VARIANTS = {"static": (False, True), "auto": (None, True), "dynamic": (True, True),
            "static*": (False, False), "dynamic*": (True, False)}


def job(env, lengths: list[int], variant: str, repeats: int) -> dict:
    torch.set_num_threads(1)
    dynamic, cache = VARIANTS[variant]
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=cache):
        return _run(env, lengths, dynamic, repeats)


def _run(env, lengths: list[int], dynamic: bool | None, repeats: int) -> dict:
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    model = Glm5NextLM.from_config()
    for mixer in model.mixers():
        mixer.compile(fullgraph=True, backend=counter, dynamic=dynamic)
    group = env.group if env.world_size > 1 else None
    first, steady, frames = [], [], []
    for seq in lengths:
        batch = PackedDocuments(seq, 1, seed=seq).batches(1)[0]
        local, ctx = fcp.shard_batch(group, batch, pad_multiple=64)
        times = []
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            train_step(model, local, ctx)
            times.append(time.perf_counter() - t0)
        first.append(times[0])
        steady.append(statistics.median(times[1:]))
        frames.append(counter.frame_count)
    return {"compile": [f - s for f, s in zip(first, steady)], "steady": steady,
            "frames": frames}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 576, 640, 768])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"# demo GLM-5.3-Flash mixers compiled (aot_eager), {args.world} rank(s), rows of "
          f"{args.lengths} tokens: compile seconds paid at each length / compiled frames")
    table = Table(("variant", ">8"), *((f"{n} tok", ">14") for n in args.lengths),
                  ("steady s", "9.3f"))  # fmt: skip
    table.header()
    res = {}
    with RankPool(max_world_size=max(2, args.world), timeout=600, job_timeout=3600) as pool:
        for variant in VARIANTS:
            ranks = pool.run(job, args.world, args.lengths, variant, args.repeats)
            r = {"compile": [max(x["compile"][i] for x in ranks) for i in range(len(args.lengths))],
                 "steady": statistics.median(ranks[0]["steady"]), "frames": ranks[0]["frames"]}
            res[variant] = r
            table.row(variant, *(f"{c:6.1f} s / {f}" for c, f in zip(r["compile"], r["frames"])),
                      r["steady"])  # fmt: skip
    static, auto, dyn = res["static"], res["auto"], res["dynamic"]
    res["ratios"] = {
        # the first dynamic compile against the first static one
        "dynamic_over_static": dyn["compile"][0] / static["compile"][0],
        "dynamic_nocache_over_static": res["dynamic*"]["compile"][0] / static["compile"][0],
        "dynamic_nocache_over_static_nocache": (res["dynamic*"]["compile"][0]
                                                / res["static*"]["compile"][0]),
        # auto's one recompile (dynamic) against a static recompile at the same length
        "auto_recompile_over_static": auto["compile"][1] / static["compile"][1],
        "auto_recompiles": auto["frames"][-1] // auto["frames"][0] - 1,
        "static_recompiles": static["frames"][-1] // static["frames"][0] - 1,
    }
    q = res["ratios"]
    print(f"\ndynamic=True compile / static compile: {q['dynamic_over_static']:.2f}x (target "
          f"<= 2x); with the fake-tensor cache off: {q['dynamic_nocache_over_static']:.2f}x "
          f"(against a static compile with it off: "
          f"{q['dynamic_nocache_over_static_nocache']:.2f}x); auto's recompile / a static recompile: {q['auto_recompile_over_static']:.2f}x"
          f"; recompiles over {len(args.lengths)} lengths: auto {q['auto_recompiles']}, static "
          f"{q['static_recompiles']}")
    return res


if __name__ == "__main__":
    main()
