"""Train transformers' GLM-5.3-Flash on packed documents with data x context parallelism, on a CPU.

    python examples/demo.py                          # 4 gloo ranks: CP 4 (make demo)
    python examples/demo.py --dp 2 --cp 2            # data parallel 2 x context parallel 2
    python examples/demo.py --steps 50 --cp 2        # shorter
    python examples/demo.py --model qwen4_exp        # transformers' Qwen4-Exp (Qwen3.8-Flash-Next)
    python examples/demo.py --model glm5             # fcp's home-made GLM-like example model
    torchrun --nproc-per-node 4 examples/demo.py --dp 2 --cp 2    # torchrun starts the ranks

The model is transformers' own ``glm5_next`` architecture (KDA layers with short convs, a k-pool
DSA indexed-MLA layer, MoE, hyper-connections) at the tiny size of
``examples/configs/glm5_next_tiny.json``, random init, with its token mixers on fcp
(:mod:`examples.glm5_hf`). ``--model qwen4_exp`` trains the second seed system instead:
transformers' own ``qwen4_exp`` (Qwen3.8-Flash-Next: Gated DeltaNet layers, two of them with
hashed n-gram Per-Layer Embeddings and their dilated conv, a QSA-indexed attention layer, MoE,
hyper-connections) at the size of ``examples/configs/qwen4_exp_tiny.json``
(:mod:`examples.qwen4_exp_hf`). Every step reads a global batch of packed byte-level documents of
Python's standard library; its rows are dealt to the ``--dp`` data-parallel replicas, and each
replica's rows are sharded contiguously over its ``--cp`` ranks by ``fcp.shard_batch``. FSDP2
shards the parameters over the flattened (dp, cp) mesh; each rank's loss is its token-loss sum
over the global number of loss tokens (:func:`fcp.loss.global_token_mean`), so training is
single-process training on the global batch. The token mixers are compiled with
``torch.compile(fullgraph=True)`` (``aot_eager`` by default: see ``DemoOptions.backend``).

Rank 0 checks every step against one process:

* **single process, same weights** (``--no-reference`` skips it): at step 1, every
  ``--reference-every`` steps and the last step, before the optimizer step, it gathers the full
  parameters and evaluates the same global batch without any parallelism. The losses agree to
  float32 rounding: the exactness of one step.
* **single-process twin** (``--no-twin``): an independent run in one process from the same
  initial weights, same batches, its own optimizer. It follows the parallel run to rounding level
  at first; over hundreds of steps two float32 trainings whose sums are ordered differently drift
  apart (chaotic amplification of rounding, not an error of CP).

The last line of the output, ``max relative difference vs single process: <number>``, is the
largest same-weights difference over the checked steps (the twin's without that check).

Written to ``reports/demo/`` (``report.md``, ``curves.png``, ``steps.csv``): losses, tokens per
second, bytes each rank sends per step, and compilation counts.
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
from fcp.loss import global_token_mean, loss_token_count  # noqa: E402

__all__ = ["DemoOptions", "build", "train", "main"]

MODELS = ("glm5-hf", "qwen4_exp", "glm5", "qwen3")


@dataclasses.dataclass
class DemoOptions:
    model: str = "glm5-hf"  # transformers' GLM-5.3-Flash on fcp; "qwen4_exp": transformers'
    # Qwen4-Exp on fcp; or fcp's home-made examples "glm5" / "qwen3"
    steps: int = 200
    seq_len: int = 512  # tokens per row (each row is split over the CP ranks)
    batch_size: int = 1  # rows per data-parallel replica; the global batch has dp * batch_size
    dp: int = 1
    cp: int = 4
    lr: float = 3e-3
    warmup: int = 10
    clip: float = 1.0
    seed: int = 0  # data order; the model's init seed is fixed
    compile: bool = True
    # aot_eager: ~30 s to compile 4 ranks on 2 cores against ~200 s for inductor, whose ~1.3x
    # faster steps do not pay that back within the demo's 200 steps (measured; see README)
    backend: str = "aot_eager"
    reference: bool = True  # rank 0: the same weights evaluated in one process ...
    reference_every: int = 10  # ... at step 1, every this many steps, and the last step
    twin: bool = True  # rank 0: an independent single-process run (own optimizer)
    optimizer: str = "adamw"  # or "sgd" (momentum 0.9): updates linear in the gradients
    count_bytes: bool = True  # one eager probe step counting the operators' collectives
    device: str = "cpu"  # "cuda": this rank's current CUDA device (NCCL groups)
    # the parameters' dtype; "float64" measures what float32 rounding alone does to a run (the
    # tests' noise floor)
    dtype: str = "float32"
    progress: bool = True
    log_every: int = 10
    model_overrides: dict = dataclasses.field(default_factory=dict)


def build(opts: DemoOptions) -> torch.nn.Module:
    """The model of ``opts.model`` (the same weights on every rank: fixed init seeds)."""
    if opts.model == "glm5-hf":
        from examples.glm5_hf import Glm5NextLM

        return Glm5NextLM.from_config(**opts.model_overrides)
    if opts.model == "qwen4_exp":
        from examples.qwen4_exp_hf import Qwen4ExpLM

        return Qwen4ExpLM.from_config(**opts.model_overrides)
    from examples.models import build_model

    return build_model(opts.model, **opts.model_overrides)


# ---------------------------------------------------------------------------------------------
# parallel layout
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    """Where this rank sits: its data-parallel replica, its CP group, the group FSDP and the loss
    normalisation span (every rank), and the sizes."""

    world: int
    rank: int
    dp: int
    cp: int
    dp_rank: int
    cp_group: object  # 1-D DeviceMesh, ProcessGroup or None
    all_ranks: object  # 1-D DeviceMesh over every rank, or None


def make_layout(group, opts: DemoOptions) -> Layout:
    """The (dp, cp) mesh over ``group`` (``None``: one process). With ``dp > 1`` the mesh spans
    the default group (every process); with ``dp == 1`` any group works."""
    if group is None:
        if opts.dp * opts.cp != 1:
            raise ValueError(f"dp={opts.dp} x cp={opts.cp} needs {opts.dp * opts.cp} ranks")
        return Layout(1, 0, 1, 1, 0, None, None)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if opts.dp * opts.cp != world:
        raise ValueError(f"dp={opts.dp} x cp={opts.cp} != {world} ranks")
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    device = "cuda" if opts.device == "cuda" else "cpu"
    if opts.dp == 1:
        mesh = DeviceMesh.from_group(group, device, mesh_dim_names=("cp",))
        return Layout(world, rank, 1, world, 0, mesh, mesh)
    mesh = init_device_mesh(device, (opts.dp, opts.cp), mesh_dim_names=("dp", "cp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    return Layout(world, rank, opts.dp, opts.cp, mesh["dp"].get_local_rank(), mesh["cp"], flat)


def shard_model(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """FSDP2 over every rank (the flattened data x context mesh): each block, then the root."""
    if layout.world == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=layout.all_ranks)
    fully_shard(model, mesh=layout.all_ranks)
    return model


def replica_rows(batch: dict, layout: Layout) -> dict:
    """This data-parallel replica's rows of the global batch (dealt round-robin; ``seq_lens``
    describes the packing, the one-row ``cu_seqlens`` is dropped)."""
    return {k: v[layout.dp_rank :: layout.dp] for k, v in batch.items() if k != "cu_seqlens"}


def loss_sum(model, input_ids, labels, ctx) -> torch.Tensor:
    logits = model(input_ids, ctx)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


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


def _full_state(model, layout: Layout) -> dict:
    """Every parameter in full (a collective on every rank under FSDP)."""
    if layout.world == 1:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------
# the training loop (every rank; rank 0 also runs the single-process checks)
# ---------------------------------------------------------------------------------------------
def train(group, opts: DemoOptions, *, on_step=None) -> dict:
    """Train ``opts.steps`` steps on the ``opts.dp x opts.cp`` ranks of ``group`` (``None``: one
    process) and return on every rank ``{"records", "summary", "model"}``.

    A record holds the step's global mean loss (``loss_cp``, the same on every rank), its time,
    tokens per second and bytes sent; on rank 0 also ``loss_ref`` / ``rel_diff`` (the same
    weights in one process) and ``loss_twin`` / ``twin_rel_diff`` (the independent
    single-process run).
    """
    layout = make_layout(group, opts)
    rank, world = layout.rank, layout.world
    device = torch.device(opts.device)
    model = build(opts).to(device, getattr(torch, opts.dtype))
    if opts.dtype == "float64" and hasattr(model, "config"):
        model.config._experts_implementation = "eager"  # transformers' grouped_mm: no float64
    n_params = sum(p.numel() for p in model.parameters())
    ref = copy.deepcopy(model) if (opts.reference and rank == 0) else None
    twin = copy.deepcopy(model) if (opts.twin and rank == 0) else None
    model = shard_model(model, layout)
    opt, sched = _optimizer(model, opts)
    if twin is not None:
        twin_opt, twin_sched = _optimizer(twin, opts)
    rows = opts.batch_size * layout.dp
    data = iter(PackedDocuments(opts.seq_len, rows, seed=opts.seed))
    pad_multiple = model.pad_multiple

    probe = None
    if opts.count_bytes:
        # One eager forward + backward counted by a dispatch mode before anything is compiled
        # (every step has the same shapes, hence the same collectives).
        first = replica_rows(PackedDocuments(opts.seq_len, rows, seed=opts.seed).batches(1)[0],
                             layout)  # fmt: skip
        first = {k: v.to(device) for k, v in first.items()}
        local, ctx = fcp.shard_batch(layout.cp_group, first, pad_multiple=pad_multiple)
        with CommBytes(rank, world) as probe:
            loss_sum(model, local["input_ids"], local["shift_labels"], ctx).backward()
        model.zero_grad(set_to_none=True)

    backend = CountingBackend(opts.backend, rank, world)
    counts_before = dynamo_counts()
    if opts.compile:
        for mixer in model.mixers():  # the fcp-backed token mixers, each one graph
            mixer.compile(fullgraph=True, backend=backend, dynamic=False)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    records, graphs_after_first = [], None
    for step in range(opts.steps):
        batch = {k: v.to(device) for k, v in next(data).items()}  # the global batch
        record = {"step": step + 1}

        # --- the parallel step ------------------------------------------------------------------
        t0 = time.perf_counter()
        mine = replica_rows(batch, layout)
        local, ctx = fcp.shard_batch(layout.cp_group, mine, pad_multiple=pad_multiple)
        targets = local["shift_labels"]
        total = loss_sum(model, local["input_ids"], targets, ctx)
        loss = global_token_mean(total, loss_token_count(targets), layout.all_ranks,
                                 gradient_divide_factor=world)  # fmt: skip
        loss.objective.backward()
        sync()
        t_cp = time.perf_counter() - t0

        # --- the same weights in one process (rank 0, before the optimizer step) --------------
        check = opts.reference and (
            step == 0 or (step + 1) % max(opts.reference_every, 1) == 0 or step + 1 == opts.steps
        )
        full_state = _full_state(model, layout) if check else None
        single = None
        if rank == 0 and (ref is not None or twin is not None):
            single, ctx1 = fcp.shard_batch(None, batch, pad_multiple=pad_multiple)
            single_targets = single["shift_labels"]
            n_global = loss_token_count(single_targets).clamp(min=1)
        if ref is not None and check:
            ref.load_state_dict(full_state)
            with torch.no_grad():
                loss_ref = loss_sum(ref, single["input_ids"], single_targets, ctx1) / n_global
            record["loss_ref"] = float(loss_ref)

        t2 = time.perf_counter()
        _step_optimizer(model, opt, sched, opts.clip)
        sync()
        t_cp += time.perf_counter() - t2

        tokens = rows * opts.seq_len
        record.update(
            loss_cp=float(loss.value),
            time_cp_s=t_cp,
            tokens=tokens,
            tokens_per_s=tokens / t_cp,
            op_bytes=probe.sent if probe is not None else None,
            collectives=probe.calls if probe is not None else None,
            # FSDP2: parameters all-gathered in forward and again in backward, gradients
            # reduce-scattered: (world - 1) / world of the fp32 parameter bytes each time
            fsdp_bytes=3 * 4 * n_params * (world - 1) // world,
            graphs=backend.graphs,
        )
        if "loss_ref" in record:
            record["rel_diff"] = abs(record["loss_cp"] - record["loss_ref"]) / abs(record["loss_ref"])

        # --- the independent single-process twin (rank 0) --------------------------------------
        if twin is not None:
            t3 = time.perf_counter()
            twin_loss = loss_sum(twin, single["input_ids"], single_targets, ctx1) / n_global
            twin_loss.backward()
            _step_optimizer(twin, twin_opt, twin_sched, opts.clip)
            record["time_twin_s"] = time.perf_counter() - t3
            record["loss_twin"] = float(twin_loss.detach())
            record["twin_rel_diff"] = abs(record["loss_cp"] - record["loss_twin"]) / abs(
                record["loss_twin"]
            )
        if step == 0:
            graphs_after_first = backend.graphs
        records.append(record)
        if rank == 0 and on_step is not None:
            on_step(record)

    counts = {k: v - counts_before[k] for k, v in dynamo_counts().items()}
    summary = {
        "model": opts.model,
        "layers": _layer_names(model),
        "params": n_params,
        "dp": layout.dp,
        "cp": layout.cp,
        "graphs_compiled": backend.graphs,
        "recompiles": backend.graphs - (graphs_after_first or 0),
        **counts,
    }
    return {"records": records, "summary": summary, "model": model}


def _layer_names(model) -> list[str]:
    names = []
    for mixer in model.mixers():
        n = type(mixer).__name__
        names.append("kda" if ("Linear" in n or "KDA" in n) else
                     "dsa" if ("Glm5Attention" in n or "Sparse" in n) else
                     "gdn" if "GatedDeltaNet" in n else "qsa" if "Qwen4ExpTextAttention" in n else
                     "ple" if "PLE" in n else n)  # fmt: skip
    return names


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


def _plot(recs: list, summ: dict, path: Path) -> bool:
    """The loss, difference and throughput curves as ``path``; False (and a printed note) when
    matplotlib is missing, so that a finished training still reports its numbers."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path.name} skipped; "
              "pip install matplotlib draws it)")
        path.unlink(missing_ok=True)  # an earlier run's plot would pass for this one's
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    has_ref, has_twin = "loss_ref" in recs[0], "loss_twin" in recs[0]
    checked = [r for r in recs if "loss_ref" in r]
    later = recs[1:] or recs
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    ax1.plot(steps, [r["loss_cp"] for r in recs], label=f"dp {summ['dp']} x cp {summ['cp']}", lw=2)
    if has_ref:
        ax1.plot([r["step"] for r in checked], [r["loss_ref"] for r in checked], "x", ms=4,
                 label="one process, same weights")  # fmt: skip
    if has_twin:
        ax1.plot(steps, [r["loss_twin"] for r in recs], ":", lw=1.5, label="one process, twin run")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats / byte)")
    ax1.set_title(f"{summ['model']}: training loss")
    ax1.legend()

    floor = 1e-9  # bitwise-equal steps are drawn here
    for key, label, style in (
        ("rel_diff", "one process, same weights", "o"),
        ("twin_rel_diff", "one process, twin run", "."),
    ):
        rs = [r for r in recs if key in r]
        if rs:
            ax2.semilogy([r["step"] for r in rs], [max(r[key], floor) for r in rs], style, ms=3,
                         label=label)  # fmt: skip
    if has_ref or has_twin:
        ax2.axhline(1e-4, color="red", lw=0.8, ls=":", label="1e-4")
        ax2.set_ylim(floor / 2, None)
        ax2.legend(fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_title(f"|loss parallel - loss one process| / loss (at {floor:g}: bitwise equal)",
                  fontsize=10)  # fmt: skip
    ax3.plot([r["step"] for r in later], [r["tokens_per_s"] for r in later], lw=1)
    ax3.set_ylim(bottom=0)
    ax3.set_xlabel("step")
    ax3.set_ylabel("tokens / s")
    ax3.set_title(f"step throughput (step 1, compiling: {recs[0]['time_cp_s']:.0f} s)",
                  fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(result: dict, opts: DemoOptions, out_dir: Path, wall_s: float) -> Path:
    """``steps.csv``, ``curves.png`` and ``report.md`` in ``out_dir``; returns the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recs, summ = result["records"], result["summary"]
    has_ref, has_twin = "loss_ref" in recs[0], "loss_twin" in recs[0]

    keys = list(dict.fromkeys(k for r in recs for k in r))
    checked = [r for r in recs if "loss_ref" in r]  # the steps with a same-weights check

    def cell(v):
        return "" if v is None else f"{v:.9g}" if isinstance(v, float) else str(v)

    with open(out_dir / "steps.csv", "w") as f:
        f.write(",".join(keys) + "\n")
        for r in recs:
            f.write(",".join(cell(r.get(k)) for k in keys) + "\n")

    later = recs[1:] or recs
    plotted = _plot(recs, summ, out_dir / "curves.png")

    tps = _median([r["tokens_per_s"] for r in later])
    last = recs[-1]
    compiled = (
        f"token mixers under `torch.compile(fullgraph=True, backend={opts.backend!r})`"
        if opts.compile
        else "eager (no torch.compile)"
    )
    lines = [
        "# fcp demo report",
        "",
        f"Model `{summ['model']}` ({' -> '.join(summ['layers'])}; {summ['params']:,} parameters), "
        f"{len(recs)} {opts.optimizer} steps of {summ['dp'] * opts.batch_size} x {opts.seq_len} "
        f"byte tokens of Python standard-library source, **data parallel {summ['dp']} x context "
        f"parallel {summ['cp']}** on {summ['dp'] * summ['cp']} gloo ranks, FSDP2 over all of "
        f"them, {compiled}. Wall time {wall_s:.0f} s.",
        "",
        "| | value |",
        "|---|---|",
        f"| loss, first / last step | {recs[0]['loss_cp']:.6f} / {last['loss_cp']:.6f} |",
    ]
    if has_ref:
        worst = max(checked, key=lambda r: r["rel_diff"])
        exact = sum(r["rel_diff"] == 0 for r in checked)
        lines += [
            f"| loss in one process (same weights), first / last | {recs[0]['loss_ref']:.6f} / "
            f"{last['loss_ref']:.6f} |",
            f"| max relative difference vs one process (same weights) | {worst['rel_diff']:.1e} "
            f"(step {worst['step']}); bitwise equal at {exact} of {len(checked)} checked steps |",
        ]
    if has_twin:
        first_bad = next((r["step"] for r in recs if r["twin_rel_diff"] >= 1e-4), None)
        lines += [
            f"| loss of the independent single-process twin, last step | "
            f"{last['loss_twin']:.6f} |",
            f"| max relative difference vs single process (twin), max / last | "
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
        f"| tokens / s (median after step 1) | {tps:,.0f} |",
        f"| bytes sent per rank per step, fcp's operators (CP) | {op} |",
        f"| bytes sent per rank per step, FSDP2 (parameters, gradients) | "
        f"{_fmt_bytes(last['fsdp_bytes'])} |",
        f"| graphs compiled (one per token mixer) / recompilations after step 1 / graph breaks | "
        f"{summ['graphs_compiled']} / {summ['recompiles']} / {summ['graph_breaks']} |",
        "",
        "![loss, CP vs no CP, throughput](curves.png)" if plotted
        else "(no plot: matplotlib is not installed)",
        "",
        "*One process, same weights*: rank 0 gathers the current parameters and runs the model "
        "on the whole global batch before each optimizer step; the difference is float32 "
        "rounding only. *Twin*: an independent single-process run (same initial weights and "
        "batches, its own optimizer); training amplifies rounding differences chaotically, so "
        "over hundreds of steps it drifts away, as two single-process runs whose sums are "
        "ordered differently do.",
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
    line = f"step {r['step']:4d} | loss {r['loss_cp']:.6f}"
    if "loss_ref" in r:
        line += f" | same weights, one process {r['loss_ref']:.6f} (rel {r['rel_diff']:.0e})"
    if "loss_twin" in r:
        line += f" | twin {r['loss_twin']:.6f} (rel {r['twin_rel_diff']:.0e})"
    line += f" | {r['tokens_per_s']:5.0f} tok/s"
    if r["op_bytes"] is not None:
        line += f" | sent/rank {_fmt_bytes(r['op_bytes'] + r['fsdp_bytes'])}"
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
        checks = [n for n, on in (("same-weights single-process check", opts.reference),
                                  ("single-process twin", opts.twin)) if on]  # fmt: skip
        print(
            f"fcp demo: {opts.model} model, {opts.steps} steps, data parallel {opts.dp} x "
            f"context parallel {opts.cp} on {world} rank(s), "
            f"{opts.dp * opts.batch_size} x {opts.seq_len} tokens per step"
            + (f"; rank 0 also runs the {' and the '.join(checks)}" if checks else ""),
            flush=True,
        )
        if opts.compile:
            print(f"compiling the token mixers (torch.compile, backend {opts.backend!r}) on every "
                  "rank ...", flush=True)  # fmt: skip
        if opts.progress:
            from tqdm import tqdm

            bar = tqdm(total=opts.steps, unit="step", dynamic_ncols=True)

    def on_step(r):
        write = bar.write if bar is not None else print
        if r["step"] <= 3 or r["step"] % opts.log_every == 0 or r["step"] == opts.steps:
            write(_log_line(r))
        if bar is not None:
            post = {"loss": f"{r['loss_cp']:.4f}"}
            if "loss_ref" in r:
                post.update(rel=f"{r['rel_diff']:.0e}")
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
    msg = f"done in {wall:.0f} s: last loss {recs[-1]['loss_cp']:.6f}"
    checked = [r for r in recs if "rel_diff" in r]
    if checked:
        msg += (f"; one process with the same weights {checked[-1]['loss_ref']:.6f}, max relative "
                f"difference over {len(checked)} checked steps "
                f"{max(r['rel_diff'] for r in checked):.1e} (float32 rounding)")
    print(msg)
    print(f"graphs compiled {s['graphs_compiled']} (one per token mixer), recompilations after "
          f"step 1 {s['recompiles']}, graph breaks {s['graph_breaks']}")
    # the exactness of every step: the parallel loss against one process with the same weights
    # (the twin when that check is off); printed last whatever the report does
    final = [r["rel_diff"] for r in checked] or [r["twin_rel_diff"] for r in recs if opts.twin]
    try:
        path = write_report(result, opts, out_dir, wall)
        plot = path.parent / "curves.png"
        print(f"report: {path}  ("
              + (f"plot: {plot}, " if plot.exists() else "no plot, ")
              + f"every step: {path.parent / 'steps.csv'})")  # fmt: skip
        if opts.twin:
            worst = max(r["twin_rel_diff"] for r in recs)
            first = next((r["step"] for r in recs if r["twin_rel_diff"] >= 1e-4), None)
            print(f"single-process twin (independent training): last loss "
                  f"{recs[-1]['loss_twin']:.6f}, max relative difference {worst:.1e}"
                  + (f", below 1e-4 through step {first - 1} (float32 rounding amplified by "
                     "training)" if first else ""))  # fmt: skip
    finally:
        if final:
            print(f"max relative difference vs single process: {max(final):.3e}")
        else:
            print("max relative difference vs single process: n/a (no single-process check "
                  "ran: --no-reference and --no-twin)")
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


def parse_args(argv=None) -> tuple[DemoOptions, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="glm5-hf",
                   help="glm5-hf: transformers' GLM-5.3-Flash on fcp (default); qwen4_exp: "
                        "transformers' Qwen4-Exp (Qwen3.8-Flash-Next) on fcp; glm5 / qwen3: "
                        "fcp's home-made example models")  # fmt: skip
    p.add_argument("--layers", default=None,
                   help="glm5/qwen3 only: comma-separated mixers, e.g. kda,sparse")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--cp", type=int, default=4, help="context-parallel ranks per replica")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1, help="rows per data-parallel replica")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="aot_eager",
                   help="torch.compile backend (inductor: slower to compile, faster steps)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, NCCL")
    p.add_argument("--no-reference", action="store_true",
                   help="skip rank 0's same-weights single-process loss")
    p.add_argument("--reference-every", type=int, default=10,
                   help="steps between same-weights checks (each gathers the full parameters)")
    p.add_argument("--no-twin", action="store_true",
                   help="skip rank 0's independent single-process run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", type=Path, default=REPO / "reports" / "demo")
    a = p.parse_args(argv)
    if a.layers and a.model in ("glm5-hf", "qwen4_exp"):
        p.error("--layers applies to the glm5 / qwen3 example models")
    opts = DemoOptions(
        model=a.model,
        steps=a.steps,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        dp=a.dp,
        cp=a.cp,
        lr=a.lr,
        seed=a.seed,
        compile=not a.no_compile,
        backend=a.backend,
        reference=not a.no_reference,
        reference_every=a.reference_every,
        twin=not a.no_twin,
        progress=not a.no_progress,
        log_every=max(a.log_every, 1),
        device=a.device,
        model_overrides={"layers": tuple(a.layers.split(","))} if a.layers else {},
    )
    return opts, a.out


def main(argv=None) -> None:
    opts, out_dir = parse_args(argv)
    world = opts.dp * opts.cp
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
