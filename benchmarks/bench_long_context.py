"""Long rows: cost per token and peak memory per rank against the row length (issue 20).

    .venv/bin/python -m benchmarks.bench_long_context [--lengths 2048 8192 32768 65536]
        [--models glm5 qwen3_next] [--layouts bounded full] [--repeats 3] [--cp-length 16384]
        [--worlds 1 2 4] [--contiguous]

Models: the demo's GLM-5.3-Flash (:mod:`examples.glm5_hf`: KDA layers and one k-pool DSA
indexed-MLA layer) and transformers' Qwen3-Next at the tiny size of the tests
(``tests.support.hf_reference.QWEN3_NEXT_TINY``: Gated DeltaNet and gated GQA attention, the
dense document-causal backend on CPU), both with :func:`fcp.integrations.hf.enable_packed_cp`.
One packed row of stdlib text, forward + backward, fp32, one intra-op thread per rank, one
process and CP 2 (gloo). Layouts: ``bounded`` (documents of at most 1024 tokens) and ``full``
(one document filling the row).

Per case: the slowest rank's median step time per token (wall clock, and the process's CPU
time, which other load on a shared machine does not inflate), the peak resident memory of each
rank (``VmHWM`` after ``malloc_trim`` and a reset of the high-water mark; ``step`` = the peak
above the memory held before the step, ``rss`` = the whole process), the activations each rank
saves for the backward, the bytes each rank sends in one step (forward + backward), and the
speed-up of CP over one process (one document: target 1.7x at CP 2, 3.0x at CP 4 in per-rank CPU
time, with the long document's queries balanced; ``--contiguous`` also runs every CP case with
``ctx.balance=False``, the contiguous layout, side by side). Then the indexer alone on one document filling the
row: the (query, pool) pairs its banded kernel scores and its time, against the full
``[local, pools]`` matrix that scoring every pool of the row costs (both measured in this run).

gloo ranks share the machine's cores: CP times are pessimistic; memory figures are per process.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
import torch.distributed as dist

import fcp
from examples.data import PackedDocuments, iter_documents, make_batch
from tests.support.rank_pool import RankPool

BOUNDED_DOC = 1024
MIB = 2**20


# ---------------------------------------------------------------------------------- memory
def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> int:
    """Give freed heap back to the system, reset the high-water mark; the RSS now."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _vm("VmRSS")


# ---------------------------------------------------------------------------------- models
def _model(name: str):
    if name == "glm5":
        from examples.glm5_hf import Glm5NextLM

        return Glm5NextLM.from_config(), 256
    from fcp.integrations.hf import enable_packed_cp
    from tests.support.hf_reference import QWEN3_NEXT_TINY, build

    return enable_packed_cp(build("qwen3_next", QWEN3_NEXT_TINY).train()), QWEN3_NEXT_TINY[
        "vocab_size"
    ]


def _loss(name, model, local, ctx, vocab):
    ids = local["input_ids"] % vocab
    if name == "glm5":
        logits = model(ids, ctx)
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), local["shift_labels"].flatten(), ignore_index=-100, reduction="sum"
        )
    # under a context enable_packed_cp hands the model an empty mask mapping: no [seq, seq]
    # causal mask is built (16 GiB at 64k tokens)
    out = model(input_ids=ids, cp_context=ctx).last_hidden_state
    return out.float().square().mean()


def _batch(seq: int, layout: str):
    if layout == "full":  # one document filling the row: stdlib files joined, cut at the row
        docs, text = iter_documents(seq, seed=0, vary_lengths=False), b""
        while len(text) < seq:
            text += next(docs)
        return make_batch([[text[:seq]]], seq)
    return PackedDocuments(seq, 1, seed=0, max_doc_len=BOUNDED_DOC).batches(1)[0]


def case_job(env, name: str, seq: int, layout: str, repeats: int, balance: bool = True) -> dict:
    from examples.comm_accounting import CommBytes

    torch.set_num_threads(1)
    model, vocab = _model(name)
    group = env.group if env.world_size > 1 else None
    local, ctx = fcp.shard_batch(group, _batch(seq, layout))
    ctx = ctx if balance else ctx.replace(balance=False)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    def step():
        model.zero_grad(set_to_none=True)
        _loss(name, model, local, ctx, vocab).backward()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()  # warm-up, and the saved-activation count
    model.zero_grad(set_to_none=True)
    before = _reset_peak()
    times, cpu = [], []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _vm("VmHWM")
    with CommBytes(env.rank, env.world_size) as comm:  # one more step, counted
        step()
    return dict(times=times, cpu=cpu, saved=saved[0], peak_rss=peak, peak_step=peak - before,
                local=ctx.local_seq_len, sent=comm.sent)  # fmt: skip


def run_case(pool, name, seq, layout, world, repeats, balance=True) -> dict:
    res = pool.run(case_job, world, name, seq, layout, repeats, balance)
    slowest = [max(r["times"][i] for r in res) for i in range(repeats)]
    busiest = [max(r["cpu"][i] for r in res) for i in range(repeats)]
    med, cpu = statistics.median(slowest), statistics.median(busiest)
    return dict(model=name, tokens=seq, layout=layout, world=world, seconds=med, cpu_seconds=cpu,
                us_per_token=med / seq * 1e6, cpu_us_per_token=cpu / seq * 1e6,
                saved=max(r["saved"] for r in res),
                peak_rss=max(r["peak_rss"] for r in res),
                peak_step=max(r["peak_step"] for r in res), local=res[0]["local"],
                sent=max(r["sent"] for r in res), balance=balance)  # fmt: skip


# ---------------------------------------------------------------------------------- indexer
def indexer_job(env, seq: int, repeats: int) -> dict | None:
    """The demo's indexer shapes on one document of ``seq`` tokens: the banded kernel against
    the full score matrix of the same queries and pooled keys (scores + top-k selection)."""
    from fcp.ops.kit import pools

    if not hasattr(pools, "scored_pairs"):
        return None
    torch.set_num_threads(1)
    hi, di, kpool, topk = 2, 16, 4, 32
    g = torch.Generator().manual_seed(0)
    ctx = fcp.PackedContext(torch.ones(1, seq, dtype=torch.long))
    q = torch.randn(1, seq, hi, di, generator=g)
    keys = torch.randn(1, seq, di, generator=g)
    gate = torch.randn(1, seq, di, generator=g)
    ape = torch.randn(kpool, di, generator=g)
    w = torch.randn(1, seq, hi, generator=g)

    def banded():
        return fcp.kpool_indexer(q, keys, gate, ape, w, ctx, topk=topk, kpool=kpool)

    def full():  # every pool of the row scored, masked afterwards (the pre-issue-20 pipeline)
        from fcp.ops.kpool_indexer.pooled import pooled_keys

        plan = pools.plan_pools(ctx, kpool)
        kt = pools.gather_pool_keys(pooled_keys(keys, gate, ape, plan.ends, ctx, kpool), ctx)
        score = pools.relu_head_scores(q, kt.transpose(1, 2), w, di**-0.5)
        return pools.top_pools(score, pools.visible_pools(plan.slots, ctx), topk // kpool)

    out = {}
    for label, fn in (("banded", banded), ("full", full)):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[label] = statistics.median(ts)
    pairs = pools.scored_pairs(ctx, kpool)
    full_pairs = ctx.local_seq_len * pools.slot_capacity(ctx.local_seq_len, kpool)
    return dict(tokens=seq, banded_s=out["banded"], full_s=out["full"], pairs=pairs,
                full_pairs=full_pairs)  # fmt: skip


# ---------------------------------------------------------------------------------- main
def _print_rows(rows):
    print(f"{'model':>10} {'layout':>7} {'tokens':>6} {'world':>5} {'us/token':>9} "
          f"{'cpu us/tok':>10} {'CP2 x':>6} {'cpu x':>6} {'peak RSS MiB':>12} "
          f"{'step peak MiB':>13} {'step KiB/tok':>12} {'saved MiB/rank':>14} "
          f"{'sent MiB/rank':>13}")  # fmt: skip
    for r in rows:
        one = next((b for b in rows if b["model"] == r["model"] and b["layout"] == r["layout"]
                    and b["tokens"] == r["tokens"] and b["world"] == 1), None)  # fmt: skip
        if one and r["world"] > 1:
            sp = f"{one['seconds'] / r['seconds']:6.2f} {one['cpu_seconds'] / r['cpu_seconds']:6.2f}"
        else:
            sp = f"{'':6} {'':6}"
        layout = r["layout"] + ("" if r.get("balance", True) else "/contig")
        print(f"{r['model']:>10} {layout:>7} {r['tokens'] // 1024:5d}k {r['world']:5d} "
              f"{r['us_per_token']:9.1f} {r['cpu_us_per_token']:10.1f} {sp} "
              f"{r['peak_rss'] / MIB:12.0f} {r['peak_step'] / MIB:13.0f} "
              f"{r['peak_step'] / r['local'] / 1024:12.1f} {r['saved'] / MIB:14.1f} "
              f"{r['sent'] / MIB:13.1f}")


def summary(rows, idx_rows, cp_length) -> list[dict]:
    """The issue's targets as ratios (each a dict: measure, value, target such as ``"<= 1.3"``,
    ok)."""
    out = []

    def add(measure, v, rule, bound):
        ok = v <= bound if rule == "<=" else v >= bound
        out.append(dict(measure=measure, value=v, target=f"{rule} {bound}", ok=ok))

    def get(model, layout, tokens, world=1):
        return next((r for r in rows if (r["model"], r["layout"], r["tokens"], r["world"]) ==
                     (model, layout, tokens, world) and r.get("balance", True)), None)  # fmt: skip

    for r in rows:  # one document filling the row: balanced CP 2 / CP 4 vs one rank
        one = get(r["model"], "full", r["tokens"])
        if r["layout"] == "full" and r["world"] in (2, 4) and r["balance"] and one:
            add(f"{r['model']} one {r['tokens'] // 1024}k document: CP {r['world']} speed-up "
                "(per-rank cpu)", one["cpu_seconds"] / r["cpu_seconds"], ">=",
                {2: 1.7, 4: 3.0}[r["world"]])

    for model in sorted({r["model"] for r in rows}):
        lens = sorted({r["tokens"] for r in rows if r["model"] == model and r["world"] == 1
                       and r["layout"] == "bounded"})  # fmt: skip
        small = get(model, "bounded", min(lens)) if lens else None
        mid = get(model, "bounded", 8192)
        for n in (n for n in lens if n > small["tokens"]):
            r = get(model, "bounded", n)
            for kind, what in (("us_per_token", "wall"), ("cpu_us_per_token", "cpu")):
                add(f"{model} bounded docs: us/token ({what}) at {n // 1024}k / "
                    f"{small['tokens'] // 1024}k", r[kind] / small[kind], "<=", 1.3)
            for kind in ("peak_rss", "peak_step") if mid and n > 8192 else ():
                add(f"{model} bounded docs: {kind} per token at {n // 1024}k / 8k",
                    (r[kind] / n) / (mid[kind] / 8192), "<=", 1.2)
        cp1, cp2 = get(model, "bounded", cp_length), get(model, "bounded", cp_length, 2)
        if model == "glm5" and cp1 and cp2:
            tag = f"glm5 bounded docs {cp_length // 1024}k"
            for kind, what in (("seconds", "wall"), ("cpu_seconds", "cpu")):
                add(f"{tag}: CP 2 speed-up ({what})", cp1[kind] / cp2[kind], ">=", 1.7)
            add(f"{tag}: saved activations per rank, CP 2 / 1 rank", cp2["saved"] / cp1["saved"],
                "<=", 0.55)
    for r in idx_rows:
        tag = f"indexer, one {r['tokens'] // 1024}k document"
        add(f"{tag}: scored pairs / full matrix", r["pairs"] / r["full_pairs"], "<=", 0.55)
        add(f"{tag}: time / full matrix", r["banded_s"] / r["full_s"], "<=", 0.55)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--full-lengths", type=int, nargs="*", default=None,
                    help="lengths of the one-document layout (default: --lengths)")
    ap.add_argument("--models", nargs="+", default=["glm5", "qwen3_next"])
    ap.add_argument("--layouts", nargs="+", default=["bounded", "full"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cp-length", type=int, default=16384)
    ap.add_argument("--indexer-lengths", type=int, nargs="*", default=[32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contiguous", action="store_true",
                    help="also run every CP case with ctx.balance=False (the contiguous layout)")
    args = ap.parse_args(argv)
    full_lengths = args.lengths if args.full_lengths is None else args.full_lengths
    rows, idx_rows = [], []
    print("# fwd+bwd, one packed row, fp32, 1 thread per rank; bounded = documents <= "
          f"{BOUNDED_DOC} tokens, full = one document filling the row", flush=True)
    with RankPool(max_world_size=max(args.worlds), timeout=1800, job_timeout=7200) as pool:
        for model in args.models:
            for layout in args.layouts:
                lens = sorted(set(args.lengths if layout == "bounded" else full_lengths)
                              | ({args.cp_length} if model == "glm5" and layout == "bounded"
                                 and args.cp_length else set()))  # fmt: skip
                for seq in lens:
                    for world in args.worlds:
                        for balance in (True, False) if args.contiguous and world > 1 else (True,):
                            rows.append(run_case(pool, model, seq, layout, world, args.repeats,
                                                 balance))  # fmt: skip
                            print(f"  {model} {layout} {seq} x{world} balance={balance}: "
                                  f"{rows[-1]['us_per_token']:.1f} us/token", flush=True)
        for seq in args.indexer_lengths:
            r = pool.run(indexer_job, 1, seq, args.repeats)[0]
            if r is not None:
                idx_rows.append(r)
    _print_rows(rows)
    for r in idx_rows:
        print(f"# indexer alone, one document of {r['tokens']} tokens (Hi 2, Di 16, kpool 4): "
              f"banded kernel scores {r['pairs']} (query, pool) pairs in {r['banded_s']:.3f} s; "
              f"the full matrix {r['full_pairs']} pairs in {r['full_s']:.3f} s")
    targets = summary(rows, idx_rows, args.cp_length)
    print("# targets")
    for t in targets:
        print(f"  {t['measure']}: {t['value']:.2f} (target {t['target']}) "
              f"{'met' if t['ok'] else 'MISSED'}")
    return dict(rows=rows, indexer=idx_rows, targets=targets)


if __name__ == "__main__":
    main()
