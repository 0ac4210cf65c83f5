"""Train a tiny GLM-5.3-Flash-like hybrid with 4-way context parallelism on a laptop CPU.

    python examples/demo.py                       # starts 4 gloo CP ranks itself (make demo)
    python examples/demo.py --steps 50 --cp 2     # shorter, 2 ranks
    torchrun --nproc-per-node 4 examples/demo.py  # or let torchrun start the ranks

Every rank reads the same packed batch of Python standard-library source (byte tokens), keeps its
contiguous quarter with ``fcp.shard_batch`` and runs the ``torch.compile(fullgraph=True)`` model
on it; the token mixers (short conv, KDA, sparse attention) exchange only what they need. After
the backward pass the per-rank partial parameter gradients are summed over the CP group (one
all-reduce) and every rank takes the same AdamW step.

Rank 0 checks every step against the model without CP:

* **no CP, same weights**: before the optimizer step it runs the same model, with the same
  weights, on the whole (unsharded) batch. The two losses agree to float32 rounding (relative
  difference ~1e-7, often bitwise) at every step: this is the exactness of fcp's CP.
* **twin**: an independent training run without CP from the same initial weights, same
  batches, its own optimizer. It follows the CP run to rounding level for the first ~100 steps;
  after that the two drift apart slowly, as any two float32 trainings whose sums run in a
  different order do (training amplifies rounding chaotically; two non-CP runs that differ only
  in KDA's chunk size drift the same way).

Printed and written to ``reports/demo/`` (``report.md``, ``curves.png``, ``steps.csv``): the
losses, tokens per second of the CP step, bytes each rank sends per step (read from the compiled
forward and backward graphs' collectives, or counted by a ``TorchDispatchMode`` in eager mode,
plus the gradient all-reduce) and how many graphs ``torch.compile`` built (one: new packings never
recompile).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python examples/demo.py` puts examples/, not the repo, on the path
    sys.path.insert(0, str(REPO))

import fcp  # noqa: E402
from examples.comm_accounting import CommBytes, CountingBackend, dynamo_counts  # noqa: E402
from examples.data import PackedDocuments  # noqa: E402
from examples.models import (  # noqa: E402
    all_reduce_grads,
    build_model,
    count_loss_tokens,
    token_loss_sum,
)

__all__ = ["DemoOptions", "train", "main"]


@dataclasses.dataclass
class DemoOptions:
    model: str = "glm5"  # "glm5" (GLM-5.3-Flash-like) or "qwen3" (Qwen3.8-Flash-Next-like)
    steps: int = 200
    seq_len: int = 512  # tokens per row (the global sequence, split over the CP ranks)
    batch_size: int = 1
    lr: float = 3e-3
    warmup: int = 10
    clip: float = 1.0
    seed: int = 0  # data order; the model's init seed is its config's
    compile: bool = True
    backend: str = "aot_eager"  # fastest to compile on CPU; inductor unrolls KDA's chunk loop
    reference: bool = True  # rank 0 also evaluates every step's weights without CP
    twin: bool = True  # rank 0 also trains an independent non-CP twin (own optimizer)
    optimizer: str = "adamw"  # or "sgd" (momentum 0.9): updates linear in the gradients
    count_bytes: bool = True  # eager / non-aot_eager runs: one extra eager probe step
    device: str = "cpu"  # "cuda": this rank's current CUDA device (NCCL groups)
    progress: bool = True
    log_every: int = 10
    model_overrides: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# the training loop (every rank; rank 0 also runs the non-CP checks)
# ---------------------------------------------------------------------------------------------
def _loss_sum(model, input_ids, labels, ctx):
    return token_loss_sum(model(input_ids, ctx), labels)


def _optimizer(model, opts: DemoOptions):
    if opts.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9)
    elif opts.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {opts.optimizer!r}")
    warm = max(opts.warmup, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def _step_optimizer(model, opt, sched, clip):
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def train(group, opts: DemoOptions, *, on_step=None) -> dict:
    """Train ``opts.steps`` steps with CP over ``group`` (``None``: no CP) on this rank.

    Every rank of ``group`` must call it with the same options. ``on_step(record)`` is called
    on rank 0 after every step. Returns on every rank ``{"records": [...], "summary": {...},
    "model": the CP model}``. A record holds the step's CP loss (summed over the ranks: the
    global mean), its time, tokens per second and bytes sent; on rank 0 also

    * ``loss_ref`` / ``rel_diff``: the same model, same weights, same batch, evaluated without
      CP on the whole sequence (``opts.reference``): the exactness of CP, step after step;
    * ``loss_twin`` / ``twin_rel_diff``: an independent non-CP training run from the same
      initial weights with its own optimizer (``opts.twin``). It tracks the CP run to float32
      rounding at first; like any two float32 trainings whose sums are ordered differently it
      drifts away over hundreds of steps (chaotic amplification, not a CP error).
    """
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    device = torch.device(opts.device)
    model = build_model(opts.model, **opts.model_overrides).to(device)
    twin = copy.deepcopy(model) if (opts.twin and rank == 0) else None
    opt, sched = _optimizer(model, opts)
    if twin is not None:
        twin_opt, twin_sched = _optimizer(twin, opts)

    backend = CountingBackend(opts.backend, rank, world)
    counts_before = dynamo_counts()
    step_fn = _loss_sum
    if opts.compile:
        step_fn = torch.compile(_loss_sum, fullgraph=True, backend=backend)
    data = iter(PackedDocuments(opts.seq_len, opts.batch_size, seed=opts.seed))
    n_params = sum(p.numel() for p in model.parameters())
    pad_multiple = model.pad_multiple
    probe = None
    if opts.count_bytes and not (opts.compile and backend.counts_bytes):
        # Eager, or a backend whose graphs we do not read: count one eager forward + backward
        # under CommBytes first (every step has the same shapes, hence the same collectives;
        # a dispatch mode on every step would slow eager steps down several times).
        first = PackedDocuments(opts.seq_len, opts.batch_size, seed=opts.seed).batches(1)[0]
        first = {k: v.to(device) for k, v in first.items()}
        local, ctx = fcp.shard_batch(group, first, pad_multiple=pad_multiple)
        with CommBytes(rank, world) as probe:
            _loss_sum(model, local["input_ids"], local["labels"], ctx).backward()
        model.zero_grad(set_to_none=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    records = []
    for step in range(opts.steps):
        batch = next(data)  # the same full batch on every rank
        n_tokens = count_loss_tokens(batch["labels"])
        real_tokens = int((fcp.doc_ids_from_seq_lens(batch["seq_lens"], opts.seq_len) > 0).sum())
        batch = {k: v.to(device) for k, v in batch.items()}
        record = {"step": step + 1}

        # --- CP step: forward + backward on this rank's slice, grads summed over the group ----
        t0 = time.perf_counter()
        local, ctx = fcp.shard_batch(group, batch, pad_multiple=pad_multiple)
        sent0, calls0 = backend.sent, backend.calls
        loss = step_fn(model, local["input_ids"], local["labels"], ctx) / n_tokens
        loss.backward()
        loss_cp = all_reduce_grads(model, group, extra=loss.detach())
        sync()
        t_cp = time.perf_counter() - t0

        # --- the same weights and batch without CP (rank 0, before the optimizer step) -------
        need_full = rank == 0 and (opts.reference or twin is not None)
        if need_full:
            full, ctx1 = fcp.shard_batch(None, batch, pad_multiple=pad_multiple)
        if opts.reference and rank == 0:
            t1 = time.perf_counter()
            with torch.no_grad():
                loss_ref = _loss_sum(model, full["input_ids"], full["labels"], ctx1) / n_tokens
            sync()
            record["time_ref_s"] = time.perf_counter() - t1
            record["loss_ref"] = float(loss_ref)

        t2 = time.perf_counter()
        grad_numel = sum(p.numel() for p in model.parameters() if p.grad is not None)
        _step_optimizer(model, opt, sched, opts.clip)
        sync()
        t_cp += time.perf_counter() - t2

        if probe is not None:
            op_bytes, op_calls = probe.sent, probe.calls
        elif opts.count_bytes:
            op_bytes, op_calls = backend.sent - sent0, backend.calls - calls0
        else:
            op_bytes = op_calls = None
        record.update(
            loss_cp=float(loss_cp),
            time_cp_s=t_cp,
            tokens=opts.batch_size * opts.seq_len,
            real_tokens=real_tokens,
            tokens_per_s=opts.batch_size * opts.seq_len / t_cp,
            op_bytes=op_bytes,
            grad_bytes=2 * (grad_numel + 1) * 4 * (world - 1) // world if world > 1 else 0,
            collectives=op_calls,
            graphs=backend.graphs,
        )
        if "loss_ref" in record:
            ref = record["loss_ref"]
            record["rel_diff"] = abs(record["loss_cp"] - ref) / abs(ref)

        # --- the independent non-CP twin: own weights, own optimizer (rank 0) ----------------
        if twin is not None:
            t3 = time.perf_counter()
            loss_twin = _loss_sum(twin, full["input_ids"], full["labels"], ctx1) / n_tokens
            loss_twin.backward()
            _step_optimizer(twin, twin_opt, twin_sched, opts.clip)
            sync()
            record["time_twin_s"] = time.perf_counter() - t3
            record["loss_twin"] = float(loss_twin.detach())
            record["twin_rel_diff"] = abs(record["loss_cp"] - record["loss_twin"]) / abs(
                record["loss_twin"]
            )
        records.append(record)
        if rank == 0 and on_step is not None:
            on_step(record)

    counts = {k: v - counts_before[k] for k, v in dynamo_counts().items()}
    summary = {
        "model": opts.model,
        "layers": list(model.cfg.layers),
        "params": n_params,
        "cp": world,
        "graphs_compiled": backend.graphs,
        "recompiles": max(backend.graphs - 1, 0),
        **counts,
    }
    if twin is not None:
        with torch.no_grad():
            summary["twin_param_rel_diff"] = max(
                float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                for a, b in zip(model.parameters(), twin.parameters())
            )
    return {"records": records, "summary": summary, "model": model}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def write_report(result: dict, opts: DemoOptions, out_dir: Path, wall_s: float) -> Path:
    """``steps.csv``, ``curves.png`` and ``report.md`` in ``out_dir``; returns the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recs, summ = result["records"], result["summary"]
    steps = [r["step"] for r in recs]
    has_ref, has_twin = "loss_ref" in recs[0], "loss_twin" in recs[0]

    keys = list(recs[0])
    with open(out_dir / "steps.csv", "w") as f:
        f.write(",".join(keys) + "\n")
        for r in recs:
            f.write(",".join(f"{r[k]:.9g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
            f.write("\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    ax1.plot(steps, [r["loss_cp"] for r in recs], label=f"CP over {summ['cp']} ranks", lw=2)
    if has_ref:
        ax1.plot(steps, [r["loss_ref"] for r in recs], "--", lw=1.5, label="no CP, same weights")
    if has_twin:
        ax1.plot(steps, [r["loss_twin"] for r in recs], ":", lw=1.5, label="no CP, twin run")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats / byte)")
    ax1.set_title(f"{summ['model']}: training loss")
    ax1.legend()

    floor = 1e-9  # bitwise-equal steps are drawn here
    for key, label, style in (
        ("rel_diff", "no CP, same weights", "o"),
        ("twin_rel_diff", "no CP, twin run", "."),
    ):
        if key in recs[0]:
            ax2.semilogy(steps, [max(r[key], floor) for r in recs], style, ms=3, label=label)
    if has_ref or has_twin:
        ax2.axhline(1e-4, color="red", lw=0.8, ls=":", label="1e-4")
        ax2.set_ylim(floor / 2, None)
        ax2.legend(fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_title(f"|loss CP - loss no CP| / loss (drawn at {floor:g}: bitwise equal)", fontsize=10)
    later = recs[1:] or recs
    ax3.plot([r["step"] for r in later], [r["tokens_per_s"] for r in later], lw=1)
    ax3.set_ylim(bottom=0)
    ax3.set_xlabel("step")
    ax3.set_ylabel("tokens / s")
    ax3.set_title(f"CP step throughput (step 1, compiling: {recs[0]['time_cp_s']:.0f} s)",
                  fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=100)
    plt.close(fig)

    tps = _median([r["tokens_per_s"] for r in later])
    last = recs[-1]
    compiled = (
        f"`torch.compile(fullgraph=True, backend={opts.backend!r})`"
        if opts.compile
        else "eager (no torch.compile)"
    )
    lines = [
        "# fcp demo report",
        "",
        f"Model `{summ['model']}` ({' -> '.join(summ['layers'])}; {summ['params']:,} parameters), "
        f"{len(recs)} AdamW steps of {opts.batch_size} x {opts.seq_len} byte tokens of Python "
        f"standard-library source, context parallelism over **{summ['cp']} gloo ranks**, "
        f"{compiled}. Wall time {wall_s:.0f} s.",
        "",
        "| | value |",
        "|---|---|",
        f"| loss with CP, first / last step | {recs[0]['loss_cp']:.6f} / {last['loss_cp']:.6f} |",
    ]
    if has_ref:
        worst = max(recs, key=lambda r: r["rel_diff"])
        exact = sum(r["rel_diff"] == 0 for r in recs)
        lines += [
            f"| loss without CP (same weights), first / last | {recs[0]['loss_ref']:.6f} / "
            f"{last['loss_ref']:.6f} |",
            f"| max relative difference, CP vs no CP (same weights) | {worst['rel_diff']:.1e} "
            f"(step {worst['step']}); bitwise equal at {exact} of {len(recs)} steps |",
        ]
    if has_twin:
        first_bad = next((r["step"] for r in recs if r["twin_rel_diff"] >= 1e-4), None)
        lines += [
            f"| loss of the independent non-CP twin, last step | {last['loss_twin']:.6f} |",
            f"| CP vs twin relative difference, max / last | "
            f"{max(r['twin_rel_diff'] for r in recs):.1e} / {last['twin_rel_diff']:.1e}"
            + (f" (below 1e-4 through step {first_bad - 1})" if first_bad else "")
            + " |",
        ]
    op = (
        f"{_fmt_bytes(last['op_bytes'])} ({last['collectives']} collectives, forward + backward)"
        if last["op_bytes"] is not None
        else "not counted"
    )
    lines += [
        f"| tokens / s (CP step, median after step 1) | {tps:,.0f} |",
        f"| bytes sent per rank per step, operators | {op} |",
        f"| bytes sent per rank per step, gradient all-reduce | {_fmt_bytes(last['grad_bytes'])} |",
        f"| graphs compiled / recompiles / graph breaks | {summ['graphs_compiled']} / "
        f"{summ['recompiles']} / {summ['graph_breaks']} |",
        "",
        "![loss, CP vs no CP, throughput](curves.png)",
        "",
        "*No CP, same weights*: rank 0 runs the same model with the CP run's current weights on "
        "the whole batch before each optimizer step; the difference is float32 rounding only. "
        "*Twin*: an independent non-CP run (same initial weights and batches, its own optimizer); "
        "training amplifies rounding differences chaotically, so it drifts away from the CP run "
        "after ~100 steps, exactly as two non-CP runs with different kernel chunk sizes do.",
        "",
        "Every step's numbers are in `steps.csv`. Throughput is measured on rank 0 of ranks "
        "sharing the CPU with each other and with rank 0's checks: a smoke number, not a "
        "benchmark.",
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def _log_line(r: dict) -> str:
    line = f"step {r['step']:4d} | loss CP {r['loss_cp']:.6f}"
    if "loss_ref" in r:
        line += f" | no CP {r['loss_ref']:.6f} (rel {r['rel_diff']:.0e})"
    if "loss_twin" in r:
        line += f" | twin {r['loss_twin']:.6f} (rel {r['twin_rel_diff']:.0e})"
    line += f" | {r['tokens_per_s']:5.0f} tok/s"
    if r["op_bytes"] is not None:
        line += f" | sent/rank {_fmt_bytes(r['op_bytes'] + r['grad_bytes'])}"
    return line + f" | graphs {r['graphs']}"


def run(rank: int, world: int, opts: DemoOptions, out_dir: Path) -> dict | None:
    """Body of every rank once the default process group exists; rank 0 returns the result."""
    if opts.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)  # several ranks share the CPU cores
    group = dist.group.WORLD if world > 1 else None
    bar = None
    if rank == 0:
        checks = [n for n, on in (("same-weights no-CP check", opts.reference),
                                  ("non-CP twin", opts.twin)) if on]
        print(
            f"fcp demo: {opts.model} model, {opts.steps} steps, CP over {world} ranks, "
            f"{opts.batch_size} x {opts.seq_len} tokens per step"
            + (f"; rank 0 also runs the {' and the '.join(checks)}" if checks else ""),
            flush=True,
        )
        if opts.compile:
            print(f"compiling (torch.compile, backend {opts.backend!r}) on every rank ...",
                  flush=True)
        if opts.progress:
            from tqdm import tqdm

            bar = tqdm(total=opts.steps, unit="step", dynamic_ncols=True)

    def on_step(r):
        write = bar.write if bar is not None else print
        if r["step"] <= 3 or r["step"] % opts.log_every == 0 or r["step"] == opts.steps:
            write(_log_line(r))
        if bar is not None:
            post = {"CP": f"{r['loss_cp']:.4f}"}
            if "loss_ref" in r:
                post.update(noCP=f"{r['loss_ref']:.4f}", rel=f"{r['rel_diff']:.0e}")
            bar.set_postfix(post, refresh=False)
            bar.update(1)

    t0 = time.perf_counter()
    result = train(group, opts, on_step=on_step)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if rank != 0:
        return None
    s, recs = result["summary"], result["records"]
    msg = f"done in {wall:.0f} s: last loss CP {recs[-1]['loss_cp']:.6f}"
    if opts.reference:
        msg += (f", no CP (same weights) {recs[-1]['loss_ref']:.6f}; max relative difference "
                f"over {len(recs)} steps {max(r['rel_diff'] for r in recs):.1e}")
    if opts.twin:
        msg += f"; twin {recs[-1]['loss_twin']:.6f}"
    print(msg)
    print(f"graphs compiled {s['graphs_compiled']}, recompiles {s['recompiles']}, "
          f"graph breaks {s['graph_breaks']}")
    path = write_report(result, opts, out_dir, wall)
    print(f"report: {path}  (plot: {path.parent / 'curves.png'}, every step: "
          f"{path.parent / 'steps.csv'})")
    return result


def _worker(rank: int, world: int, store_path: str, opts: DemoOptions, out_dir: Path) -> None:
    dist.init_process_group(
        "nccl" if opts.device == "cuda" else "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        run(rank, world, opts, out_dir)
    finally:
        dist.destroy_process_group()


def parse_args(argv=None) -> tuple[DemoOptions, int, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("glm5", "qwen3"), default="glm5")
    p.add_argument("--layers", default=None,
                   help="comma-separated mixers overriding the model's, e.g. kda,sparse")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cp", type=int, default=4, help="CP ranks to spawn (ignored under torchrun)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, NCCL")
    p.add_argument("--no-reference", action="store_true",
                   help="skip rank 0's same-weights no-CP loss")
    p.add_argument("--no-twin", action="store_true", help="skip rank 0's independent no-CP run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", type=Path, default=REPO / "reports" / "demo")
    a = p.parse_args(argv)
    opts = DemoOptions(
        model=a.model,
        steps=a.steps,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        lr=a.lr,
        seed=a.seed,
        compile=not a.no_compile,
        backend=a.backend,
        reference=not a.no_reference,
        twin=not a.no_twin,
        progress=not a.no_progress,
        log_every=max(a.log_every, 1),
        device=a.device,
        model_overrides={"layers": tuple(a.layers.split(","))} if a.layers else {},
    )
    return opts, a.cp, a.out


def main(argv=None) -> None:
    opts, world, out_dir = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group(
            "nccl" if opts.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=600)
        )
        try:
            run(dist.get_rank(), dist.get_world_size(), opts, out_dir)
        finally:
            dist.destroy_process_group()
        return
    if world == 1:
        run(0, 1, opts, out_dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), opts, out_dir), nprocs=world)


if __name__ == "__main__":
    main()
