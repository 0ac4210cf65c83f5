"""One entry point for fcp's benchmarks: runs them side by side and writes one report.

    make bench                                  # = .venv/bin/python -m benchmarks
    .venv/bin/python -m benchmarks --quick      # smaller sizes (a few minutes)

Writes ``reports/benchmarks/report.md`` (a headline table of ratios, then every benchmark's
full output) and ``reports/benchmarks/*.png``. Every figure is a ratio of two things measured
in the same run on the same machine; times are medians (spread where the benchmark keeps one).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _capture(fn, argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rows = fn(argv)
    return rows, buf.getvalue()


def _script(name: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=False)
    text = out.stdout
    if out.returncode:
        text += f"\n(exit {out.returncode})\n" + out.stderr[-2000:]
    return text


def _plots(out: Path, comm_rows, scaling_rows) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for world in sorted({r["world"] for r in scaling_rows}):
        rs = [r for r in scaling_rows if r["world"] == world]
        ax[0].plot([r["tokens"] for r in rs], [r["us_per_token"] for r in rs], "o-",
                   label=f"{world} rank(s)")
        ax[1].plot([r["tokens"] for r in rs], [r["saved_mb"] for r in rs], "o-",
                   label=f"{world} rank(s)")
    ax[0].set(xlabel="global tokens", ylabel="us per token (slowest rank)", xscale="log",
              title="hybrid layer fwd+bwd")
    ax[1].set(xlabel="global tokens", ylabel="saved activations MB per rank", xscale="log",
              title="memory CP divides")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    files.append("scaling.png")
    plt.close(fig)

    halo = [r for r in comm_rows if r["kind"] == "halo"]
    fig, ax = plt.subplots(figsize=(5, 4))
    for h in sorted({r["history"] for r in halo}):
        rs = [r for r in halo if r["history"] == h]
        ax.plot([r["local_len"] for r in rs], [r["time_ratio"] for r in rs], "o-",
                label=f"history {h}")
    ax.set(xlabel="local tokens per rank", ylabel="naive / fcp time", xscale="log",
           yscale="log", title="left halo vs all-gather+slice")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "halo.png", dpi=100)
    files.append("halo.png")
    plt.close(fig)
    return files


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument("--out", default=str(ROOT / "reports" / "benchmarks"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    q = args.quick

    sys.path.insert(0, str(ROOT))
    from benchmarks import (
        bench_agreement,
        bench_attention,
        bench_comm,
        bench_diagonal,
        bench_gdn,
        bench_gla,
        bench_glm5_cp,
        bench_index_attention,
        bench_isolation,
        bench_kda_scan,
        bench_lengths,
        bench_long_context,
        bench_mamba2_cp,
        bench_scaling,
        bench_sliding_window,
    )

    sections = []

    def run(label: str, title: str, fn, argv: list[str]):
        """Runs one benchmark's ``main(argv)``, keeps its printout as a section; its rows."""
        print(f"{label} ...", flush=True)
        rows, text = _capture(fn, argv)
        sections.append((title, text))
        return rows

    def sized(quick: list[str], full: list[str], repeats: tuple[str, str]) -> list[str]:
        """``--lengths`` and ``--repeats`` for quick mode or for the full report."""
        return ["--lengths", *(quick if q else full), "--repeats", repeats[0] if q else repeats[1]]

    comm_rows = run("collectives", "Collectives (4 gloo ranks)", bench_comm.main,
                    ["--repeats", "5" if q else "15"])
    att_rows = run("attention", "Attention operators: bytes and CP vs single process",
                   bench_attention.main,
                   sized(["512", "1024"], ["512", "1024", "2048"], ("3", "5")))
    idx_rows = run("index attention",
                   "Index attention: time per token (1 thread) and CP bytes per layer",
                   bench_index_attention.main,
                   sized(["2048", "8192"], ["2048", "8192", "32768"], ("2", "3")))
    swa_rows = run("sliding window", "Sliding-window attention: halo bytes and cost per token",
                   bench_sliding_window.main,
                   sized(["8192", "16384"], ["8192", "16384", "32768", "65536"], ("1", "3")))
    sc_rows = run("CP scaling", "CP scaling of one hybrid layer (1/2/4 ranks)", bench_scaling.main,
                  sized(["512", "1024"], ["1024", "2048", "4096"], ("2", "3")))
    print("KDA ...", flush=True)
    kda_args = (["--lengths", "512", "1024", "2048", "--recurrent-max", "1024", "--no-compile"]
                if q else ["--lengths", "1024", "2048", "4096", "8192", "--chunk-max", "4096",
                           "--no-compile"])
    sections.append(("KDA vs FLA's naive references (CPU)", _script("bench_kda.py", kda_args)))
    gdn_rows = run("GDN", "Gated DeltaNet: scalar gate vs the gate broadcast to [.., K] (CPU)",
                   bench_gdn.main,
                   sized(["1024", "2048"], ["1024", "2048", "4096", "8192"], ("3", "5")))
    gla_row = run("gated linear attention (Mamba2's SSD)",
                  "Gated linear attention (Mamba2's SSD) vs transformers' PyTorch SSD (CPU)",
                  bench_gla.main, ["--repeats", "2" if q else "5", "--lengths",
                                   *(["1024", "4096"] if q else
                                     ["1024", "2048", "4096", "8192", "16384"])])
    diag_res = run("diagonal recurrences (Mamba1, RG-LRU, WKV, mLSTM) vs transformers; Jamba CP",
                   "Diagonal recurrences vs transformers' PyTorch paths (CPU); Jamba's Mamba "
                   "layer CP 2 vs 1 rank", bench_diagonal.main,
                   ["--repeats", "2" if q else "3", "--lengths", *(["1024"] if q else
                                                                   ["1024", "4096"]),
                    "--flat-lengths", *(["1024", "4096"] if q else ["1024", "4096", "16384"]),
                    "--cp-lengths", "2048" if q else "8192"])  # fmt: skip
    scan_row = run("KDA chunk scan vs loop (includes two cold inductor compiles)",
                   "KDA's chunk recurrence: log-depth scan vs the Python loop", bench_kda_scan.main,
                   ["--repeats", "3" if q else "7", "--compile-lens", "1024",
                    "4096" if q else "16384"])  # fmt: skip
    iso_rows = run("isolation cost", "Cost of keeping NaN/inf inside its document (hybrid layer)",
                   bench_isolation.main,
                   ["--lengths", "1024", "4096", "--repeats", "5" if q else "15"])
    glm_rows = run("GLM-5.3-Flash under CP",
                   "transformers' GLM-5.3-Flash on fcp: CP 2 vs 1 rank, bytes per DSA layer",
                   bench_glm5_cp.main, ["--lengths", *(["1024"] if q else ["1024", "4096"])])
    len_res = run("row lengths (static vs dynamic compile of the demo's mixers)",
                  "Row lengths that change: compile cost of the demo GLM-5.3-Flash's mixers",
                  bench_lengths.main, ["--repeats", "2" if q else "3"])
    agree_rows = run("agreement check",
                     "shard_batch's check that the CP ranks hold the same batch (4 gloo ranks)",
                     bench_agreement.main, ["--repeats", "10" if q else "30"])
    mamba_rows = run("Mamba2 hybrid layer under CP",
                     "transformers' Nemotron-H Mamba2 layer on fcp: CP 2 vs 1 rank",
                     bench_mamba2_cp.main, ["--lengths", "4096" if q else "8192",
                                            "--repeats", "2" if q else "5"])  # fmt: skip
    long_args = (["--lengths", "2048", "8192", "--layouts", "bounded", "--cp-length", "8192",
                  "--indexer-lengths", "8192", "--repeats", "2"] if q else
                 ["--full-lengths", "2048", "8192", "32768"])  # fmt: skip
    long_res = run("long rows (GLM-5.3-Flash and Qwen3-Next, 1 and 2 ranks)",
                   "Long rows: cost per token and peak memory per rank against the row length",
                   bench_long_context.main, long_args)
    print("layout ...", flush=True)
    sections.append(("Layout and sharding at 1M tokens / 100k documents",
                     _script("bench_layout.py", ["--repeats", "5" if q else "15",
                                                 "--threads", "1"])))

    halo = [r for r in comm_rows if r["kind"] == "halo"]
    big = max(r["local_len"] for r in halo)
    chain = [r for r in comm_rows if r["kind"] == "state_chain"]
    head = ["| measure | value |", "|---|---|"]
    for r in (r for r in halo if r["local_len"] == big):
        head.append(f"| halo (history {r['history']}, {big} tokens/rank): bytes all-gather / "
                    f"fcp | {r['bytes_ratio']:.0f}x |")
        head.append(f"| halo (history {r['history']}, {big} tokens/rank): time all-gather / "
                    f"fcp | {r['time_ratio']:.1f}x |")
    for r in chain:
        head.append(f"| state chain ({r['heads']} heads, K=V={r['k']}): time sequential "
                    f"send/recv / fcp | {r['time_ratio']:.2f}x |")
    for name in sorted({r["op"] for r in att_rows}):
        r = max((r for r in att_rows if r["op"] == name), key=lambda r: (r["seq"], r["world"]))
        head.append(f"| {name} ({r['seq']} tokens, {r['world']} ranks): bytes / full K/V "
                    f"gather | {r['predicted_bytes'] / r['full_kv_bytes']:.3f} |")
        head.append(f"| {name} ({r['seq']} tokens, {r['world']} ranks): single / CP time | "
                    f"{r['speedup']:.2f}x |")
    for kind in sorted({r["kind"] for r in idx_rows}):
        rs = [r for r in idx_rows if r["kind"] == kind]
        times = " / ".join(f"{r['us_per_token']:.0f}" for r in rs)
        sizes = "/".join(f"{r['tokens'] // 1024}k" for r in rs)
        head.append(f"| index attention ({kind}-shaped, W={rs[0]['width']}) us per token at "
                    f"{sizes} tokens (flat = cost independent of length) | {times} |")
    swa_bytes = [r for r in swa_rows if r["part"] == "bytes"]
    swa_halo = max(r["halo_received"] for r in swa_bytes)
    swa_gather = max(r["gather_received"] for r in swa_bytes)
    head.append(f"| sliding window (4096, 32k tokens, 4 ranks): halo / K/V all-gather bytes, "
                f"busiest rank | {swa_halo / swa_gather:.3f} |")
    swa_time = [r for r in swa_rows if r["part"] == "time"]
    sizes = "/".join(f"{r['tokens'] // 1024}k" for r in swa_time)
    times = " / ".join(f"{r['us_per_token']:.0f}" for r in swa_time)
    head.append(f"| sliding window us per token at {sizes} tokens | {times} |")
    for r in bench_index_attention.cp_bytes():
        head.append(f"| {r['model']} under CP: bytes / full K/V gather | "
                    f"{r['fcp'] / r['full_kv']:.3f} |")
    head.append(f"| KDA chunk recurrence by scan: inductor compile time at "
                f"{scan_row['compile_lens'][1]} / {scan_row['compile_lens'][0]} tokens (target "
                f"<= 1.5x) | {scan_row['compile_ratio']:.2f}x |")
    head.append(f"| KDA eager fwd+bwd at {scan_row['seq']} tokens, with scan / with the loop "
                f"(target <= 1.10) | {scan_row['ratio']:.3f} |")
    for r in iso_rows:
        head.append(f"| NaN/inf isolation cost, hybrid layer {r['seq']} tokens (eager, "
                    f"target <= 5%) | {100 * r['isolation_fraction']:.1f}% |")
    for r in glm_rows:
        if r["tokens"] is None:
            b = r["released"]
            head.append(f"| GLM-5.3-Flash released shapes, 4 x 32k tokens: DSA layer bytes per "
                        f"rank, fcp (latent + pooled keys) / expanded K/V / hidden states | "
                        f"{b['latent_and_pools'] / 2**20:.0f} / {b['expanded_kv'] / 2**20:.0f} / "
                        f"{b['hidden'] / 2**20:.0f} MiB |")
        else:
            head.append(f"| demo GLM-5.3-Flash {r['tokens']} tokens, CP 2 vs 1 rank: speed-up / "
                        f"saved-activation ratio | {r['speedup']:.2f}x / {r['saved_ratio']:.2f}x |")
    lr = len_res["ratios"]
    head.append(f"| demo GLM-5.3-Flash mixers, rows of 4 lengths: recompiles with Dynamo's "
                f"default / static | {lr['auto_recompiles']} / {lr['static_recompiles']} |")
    head.append(f"| demo GLM-5.3-Flash mixers: dynamic compile / static compile (target <= 2x) | "
                f"{lr['dynamic_over_static']:.2f}x |")
    head.append(f"| the same with Dynamo's fake-tensor cache off (a user setting) | "
                f"{lr['dynamic_nocache_over_static']:.2f}x |")
    ref = len_res["transformers"]["ratios"]
    head.append(f"| the same ratio for the layers' other modules (transformers' own code, no fcp): "
                f"PyTorch's floor | {ref['dynamic_over_static']:.2f}x |")
    for r in agree_rows:
        if r["check_over_step"] is not None:
            head.append(f"| shard_batch's agreement check / demo fwd+bwd step ({r['world']} "
                        f"ranks, {r['batch']}; target < 1%) | {100 * r['check_over_step']:.2f}% |")
        else:
            head.append(f"| shard_batch's agreement check / shard_batch without it ({r['batch']})"
                        f" | {100 * r['check_over_shard']:.0f}% |")
    for r in mamba_rows:
        head.append(f"| Nemotron-H Mamba2 layer {r['tokens']} tokens, CP 2 vs 1 rank: speed-up "
                    f"(wall / CPU time per rank) / saved-activation ratio | {r['speedup']:.2f}x / "
                    f"{r['cpu_speedup']:.2f}x / {r['saved_ratio']:.2f}x |")
    for t in long_res["targets"]:
        head.append(f"| {t['measure']} (target {t['target']}) | {t['value']:.2f} |")
    r = max(gdn_rows, key=lambda r: r["seq"])
    head.append(f"| GDN scalar gate vs gate broadcast to K ({r['seq']} tokens, K=V=128): time / "
                f"peak memory / saved activations, broadcast over scalar | {r['time_ratio']:.2f}x "
                f"/ {r['peak_ratio']:.2f}x / {r['saved_ratio']:.2f}x |")
    c = gla_row["compare"]
    head.append(f"| fcp.gla (Mamba2 SSD layer scan) fwd+bwd at {c['seq']} tokens vs transformers' "
                f"PyTorch mamba2_chunk_scan: speed-up (target >= 5x) / output difference | "
                f"{c['ratio']:.1f}x / {c['rel_diff']:.0e} |")
    rows = gla_row["lengths"]["heap"]
    head.append(f"| fcp.gla us per token at {rows[0]['seq'] // 1024}k / {rows[-1]['seq'] // 1024}k "
                f"tokens, heap allocator / glibc default (flat = linear) | "
                f"{rows[0]['us_per_token']:.0f} / {rows[-1]['us_per_token']:.0f}; "
                f"{gla_row['lengths']['default'][0]['us_per_token']:.0f} / "
                f"{gla_row['lengths']['default'][-1]['us_per_token']:.0f} |")
    for name, res in diag_res["ops"].items():
        c = max((r for r in res["compare"] if r["speedup"] is not None),
                key=lambda r: r["tokens"], default=None)
        f = res["flat"]
        sizes = "/".join(f"{r['tokens'] // 1024}k" for r in f)
        times = " / ".join(f"{r['us_per_token']:.1f}" for r in f)
        if c is not None:
            head.append(f"| {name} fwd+bwd at {c['tokens']} tokens vs transformers' PyTorch path: "
                        f"speed-up / output difference | {c['speedup']:.2f}x / "
                        f"{c['rel_diff']:.0e} |")
        head.append(f"| {name} (fcp) us per token at {sizes} tokens (flat = linear) | {times} |")
    for r in diag_res["cp"]:
        head.append(f"| Jamba Mamba layer {r['tokens']} tokens, CP 2 vs 1 rank: speed-up (wall / "
                    f"CPU time per rank) / saved-activation ratio | {r['speedup']:.2f}x / "
                    f"{r['cpu_speedup']:.2f}x / {r['saved_ratio']:.2f}x |")
    for r in sc_rows:
        if r["world"] > 1:
            base = next(b for b in sc_rows if b["tokens"] == r["tokens"] and b["world"] == 1)
            head.append(f"| hybrid layer {r['tokens']} tokens, {r['world']} ranks: speed-up / "
                        f"saved-activation ratio vs 1 rank | {r['speedup']:.2f}x / "
                        f"{base['saved_mb'] / r['saved_mb']:.2f}x |")
    head.append(f"| hybrid layer compiled (aot_eager) / eager time (lower is better) | "
                f"{min(r['compiled_over_eager'] for r in sc_rows):.2f}.."
                f"{max(r['compiled_over_eager'] for r in sc_rows):.2f} |")
    head.append(f"| compilations across 5 packings (max over cases) | "
                f"{max(r['compiles'] for r in sc_rows)} |")

    plots = _plots(out, comm_rows, sc_rows)
    md = [
        "# fcp benchmark report",
        "",
        f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} on "
        f"{platform.machine()} with {os.cpu_count()} CPUs, torch {torch.__version__}"
        f"{' (quick mode)' if q else ''}, by `python -m benchmarks`.",
        "",
        "How to read it: every number is a ratio of two measurements taken side by side in this",
        "run (> 1 means fcp is better unless stated). CPU gloo ranks share the machine's cores,",
        "so with 4 ranks on 2 cores times are pessimistic; byte counts and activation sizes are",
        "exact.",
        "",
        *head,
        "",
        *[f"![{p}]({p})" for p in plots],
        "",
    ]
    for title, text in sections:
        md += [f"## {title}", "", "```", text.rstrip(), "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    print(f"report written to {path}")
    return path


if __name__ == "__main__":
    main()
