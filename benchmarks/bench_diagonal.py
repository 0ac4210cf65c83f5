"""CPU benchmark: fcp's diagonal recurrences (issue 32) against transformers' own PyTorch paths.

    .venv/bin/python -m benchmarks.bench_diagonal
    .venv/bin/python -m benchmarks.bench_diagonal --lengths 1024 --flat-lengths 1024 4096 \\
        --cp-lengths 2048 --repeats 2

Forward + backward (a fixed random cotangent on the output), fp32, batch 1, one document per
row, CPU time (``time.process_time``) medians of ``--repeats`` runs after one warm-up, the two
sides interleaved in one process, ``--threads`` 1. fcp's side runs under a one-document
:class:`fcp.PackedContext` (what :func:`fcp.shard_batch` makes of one unpadded row on one rank).
transformers has no packing: on a packed row it would run once per document.

1. Each operator against transformers at ``--lengths`` tokens (transformers only up to
   ``--skip-transformers-above`` tokens, 4096: its loops are per token; Mamba1's only up to
   ``--skip-mamba1-transformers-above``, 2048: its loop's backward is quadratic in the length,
   11 s at 1024 tokens and many minutes at 4096), with the relative difference
   of the outputs (``max |fcp - hf| / max |hf|``); then fcp alone at ``--flat-lengths``
   (µs per token and its ratio to the shortest row: 1.00 = linear in the length):

   * ``mamba1``: the **whole layer** (in_proj, conv, x_proj / dt_proj, the selective scan, D
     skip, SiLU gate, out_proj): a transformers ``MambaMixer`` (hidden 128, intermediate 256,
     state N = 16, dt rank 8, conv 4) called without a context is transformers' own
     ``forward``, whose scan is ``mamba_selective_scan``'s per-token loop (no mamba_ssm, no hub
     kernel, ``use_mambapy=False``); the same module after
     :func:`fcp.integrations.hf.enable_packed_cp`, called with the context, runs
     :class:`~fcp.integrations.hf.mixers.mamba1.Mamba1Mixer`: the scan as :func:`fcp.gla` with
     a per-key decay ``a [B, L, 256, 16]`` (heads = channels, K = N, V = 1, ``q = C``, ``k = B``
     shared by all heads, ``v = dt x``, ``a = dt A``, chunks of 8);
   * ``rglru``: the scan alone, ``h_t = a_t h_{t-1} + x_t`` over C = 256 channels:
     :func:`fcp.elementwise_scan` vs ``RecurrentGemmaRglru._rnn_scan`` (its per-token loop);
     ``a`` in (0, 1), both given the same leaf tensors;
   * ``wkv``: RWKV-4's WKV alone, C = 256 channels: :func:`fcp.wkv` (``a = -exp(time_decay)``,
     ``u = time_first``) vs ``rwkv_linear_attention_cpu`` (its per-token loop, what
     ``RwkvSelfAttention`` runs off CUDA);
   * ``mlstm``: the **whole layer** (projections, soft-capped gates, the matrix memory,
     multi-head norm, output gate, out_proj): transformers' ``xLSTMLayer`` (hidden 256, 4
     heads, K = V = 64, ``mode="train"``: ``mlstm_chunkwise_native_autograd``, chunks of 64 (a
     chunk-parallel path, not a per-token loop)) vs the same module on fcp
     (:class:`~fcp.integrations.hf.mixers.mlstm.MlstmMixer`: :func:`fcp.mlstm_stabilizer` +
     :func:`fcp.gla`).

2. CP 2 vs 1 rank for a transformers ``JambaMambaMixer`` on fcp (its Mamba1 layer with dt / B /
   C RMS norms; Jamba's tiny test shapes scaled up: hidden 128, intermediate 256, N = 16, dt
   rank 8, conv 4) at ``--cp-lengths`` tokens of random packed documents on gloo ranks, as
   ``bench_mamba2_cp.py`` does for Nemotron-H's Mamba2: the slowest rank's median wall and CPU
   time, the speed-up, the activations each rank saves for the backward, and the CP output's
   difference from the single process. gloo ranks share the machine's cores: the CPU-time
   speed-up is the work per rank; the memory ratio is exact.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

import fcp
from benchmarks.common import Table, one_and_two_ranks, rank_times, saved_bytes, with_threads

MAMBA = dict(hidden_size=128, intermediate_size=256, state_size=16, time_step_rank=8,
             conv_kernel=4, num_hidden_layers=1, vocab_size=64)  # fmt: skip
CHANNELS = 256  # rglru, wkv
XLSTM = dict(hidden_size=256, num_heads=4, qk_dim_factor=1.0, v_dim_factor=1.0, mode="train",
             chunk_size=64, num_hidden_layers=1, vocab_size=64)  # fmt: skip
JAMBA = dict(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
             mamba_dt_rank=8, mamba_conv_bias=True, mamba_proj_bias=False,
             use_mamba_kernels=True, pad_token_id=0)  # fmt: skip


def _one_doc(seq: int) -> fcp.PackedContext:
    return fcp.PackedContext(torch.ones(1, seq, dtype=torch.long))


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _enabled(module):
    from fcp.integrations.hf import enable_packed_cp

    return enable_packed_cp(module)


# ---- the cases: each ``case(seq) -> (fcp(), hf(), leaves)``, both calls returning the output


def mamba1_case(seq: int):
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    torch.manual_seed(0)
    layer = _enabled(MambaMixer(MambaConfig(**MAMBA), layer_idx=0))
    x = _randn(1, seq, MAMBA["hidden_size"], seed=1).requires_grad_()
    ctx = _one_doc(seq)
    return (lambda: layer(x, cp_context=ctx)), (lambda: layer(x)), [x, *layer.parameters()]


def rglru_case(seq: int):
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    rglru = RecurrentGemmaRglru(RecurrentGemmaConfig(hidden_size=CHANNELS, lru_width=CHANNELS,
                                                     num_attention_heads=4))  # fmt: skip
    x = _randn(1, seq, CHANNELS, seed=1).requires_grad_()
    a = torch.sigmoid(_randn(1, seq, CHANNELS, seed=2) + 2).requires_grad_()
    reset = torch.zeros(1, seq, 1, dtype=torch.bool)
    reset[:, 0] = True  # transformers' position_ids == 0
    ctx = _one_doc(seq)
    return ((lambda: fcp.elementwise_scan(x, a, ctx)),
            (lambda: rglru._rnn_scan(x, a, reset, None)[0]), [x, a])  # fmt: skip


def wkv_case(seq: int):
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    k = _randn(1, seq, CHANNELS, seed=1).requires_grad_()
    v = _randn(1, seq, CHANNELS, seed=2).requires_grad_()
    decay = (_randn(CHANNELS, seed=3) - 1).requires_grad_()  # RWKV's time_decay (a log log)
    first = _randn(CHANNELS, seed=4).requires_grad_()  # time_first
    ctx = _one_doc(seq)
    return ((lambda: fcp.wkv(k, v, -torch.exp(decay), first, ctx)),
            (lambda: rwkv_linear_attention_cpu(decay, first, k, v)[0]), [k, v, decay, first])


def mlstm_case(seq: int):
    from transformers import xLSTMConfig
    from transformers.models.xlstm.modeling_xlstm import xLSTMLayer

    if seq % XLSTM["chunk_size"]:
        raise ValueError(f"mlstm: {seq} tokens is not a multiple of transformers' chunk "
                         f"{XLSTM['chunk_size']} (its mode='train')")  # fmt: skip
    torch.manual_seed(0)
    layer = _enabled(xLSTMLayer(xLSTMConfig(**XLSTM)))
    x = _randn(1, seq, XLSTM["hidden_size"], seed=1).requires_grad_()
    ctx = _one_doc(seq)
    return ((lambda: layer(x, cp_context=ctx)[0]), (lambda: layer(x)[0]),
            [x, *layer.parameters()])  # fmt: skip


CASES = {
    "mamba1": ("Mamba1 layer: fcp.gla (per-key decay) vs MambaMixer.forward (per-token loop)",
               mamba1_case),
    "rglru": ("RG-LRU scan: fcp.elementwise_scan vs RecurrentGemmaRglru._rnn_scan", rglru_case),
    "wkv": ("RWKV-4 WKV: fcp.wkv vs rwkv_linear_attention_cpu", wkv_case),
    "mlstm": ("xLSTM mLSTM layer: mlstm_stabilizer + gla vs xLSTMLayer (chunkwise, train mode)",
              mlstm_case),
}


def _step(fn, leaves, cotangent: dict) -> torch.Tensor:
    for t in leaves:
        t.grad = None
    out = fn()
    if "g" not in cotangent:
        cotangent["g"] = _randn(*out.shape, seed=9)
    out.backward(cotangent["g"])
    return out.detach()


def _medians(steps: dict, repeats: int) -> tuple[dict, dict]:
    """``({name: median CPU seconds}, {name: the warm-up's output})``: one warm-up each, then
    ``repeats`` rounds with the steps interleaved."""
    outs = {name: step() for name, step in steps.items()}
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.process_time()
            step()
            times[name].append(time.process_time() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}, outs


def compare(name: str, lengths, flat_lengths, repeats: int, skip_above: int) -> dict:
    title, case = CASES[name]
    print(f"\n# {title}")
    table = Table(("tokens", "7d"), ("fcp ms", "10.1f"), ("transformers ms", "15.1f"),
                  ("speed-up", "8.2f"), ("rel diff", "8.1e"))  # fmt: skip
    table.header()
    rows = []
    for seq in lengths:
        fcp_fn, hf_fn, leaves = case(seq)
        cot = {}
        steps = {"fcp": lambda: _step(fcp_fn, leaves, cot)}
        if seq <= skip_above:
            steps["hf"] = lambda: _step(hf_fn, leaves, cot)
        t, outs = _medians(steps, repeats)
        if "hf" in t:
            diff = float((outs["fcp"] - outs["hf"]).abs().max() / outs["hf"].abs().max())
            table.row(seq, 1e3 * t["fcp"], 1e3 * t["hf"], t["hf"] / t["fcp"], diff)
            rows.append(dict(op=name, tokens=seq, fcp_s=t["fcp"], hf_s=t["hf"],
                             speedup=t["hf"] / t["fcp"], rel_diff=diff))  # fmt: skip
        else:
            table.row(seq, 1e3 * t["fcp"], "skipped", "-", "-")
            rows.append(dict(op=name, tokens=seq, fcp_s=t["fcp"], hf_s=None, speedup=None,
                             rel_diff=None))  # fmt: skip
    print("# fcp: cost per token against the row length (the rows above reused)")
    table = Table(("tokens", "7d"), ("fcp ms", "10.1f"), ("us/token", "9.2f"),
                  ("vs first", "8.2f"))  # fmt: skip
    table.header()
    flat = []
    for seq in flat_lengths:
        sec = next((r["fcp_s"] for r in rows if r["tokens"] == seq), None)  # measured above
        if sec is None:
            fcp_fn, _, leaves = case(seq)
            cot = {}
            sec = _medians({"fcp": lambda: _step(fcp_fn, leaves, cot)}, repeats)[0]["fcp"]
        per = 1e6 * sec / seq
        flat.append(dict(op=name, tokens=seq, fcp_s=sec, us_per_token=per))
        table.row(seq, 1e3 * sec, per, per / flat[0]["us_per_token"])
    return dict(compare=rows, flat=flat)


# ---- part 2: Jamba's Mamba layer under CP (bench_mamba2_cp.py's structure)


def _jamba_layer():
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    torch.manual_seed(0)
    return _enabled(JambaMambaMixer(JambaConfig(**JAMBA), layer_idx=0))


def _doc_ids(seq: int) -> torch.Tensor:
    """One row of random documents of 64 .. seq / 3 tokens (the last one cut at ``seq``)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, max(65, seq // 3), (1, 64), generator=gen)
    lens = torch.where(lens.cumsum(1) > seq, torch.full_like(lens, -1000), lens)
    return fcp.doc_ids_from_seq_lens(lens, seq)


def jamba_cp_job(env, seq: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    layer = _jamba_layer()
    group = env.group if env.world_size > 1 else None
    ctx = fcp.PackedContext(_doc_ids(seq), group=group, cp_size=env.world_size, cp_rank=env.rank)
    x = ctx.shard(_randn(1, seq, JAMBA["hidden_size"], seed=1)).requires_grad_()

    def step():
        out = layer(x, cp_context=ctx)
        out.pow(2).mean().backward()
        return out

    out, saved = saved_bytes(step)  # also the warm-up
    times, cpu = rank_times(step, layer, repeats, group)
    return dict(seconds=times, cpu=cpu, saved=saved, out=out.detach())


def jamba_cp(lengths, repeats: int) -> list[dict]:
    print("\n# transformers' Jamba Mamba layer (JambaMambaMixer) on fcp, one packed row, fwd+bwd, "
          "fp32: CP 2 vs 1 rank (1 thread per rank)")  # fmt: skip
    table = Table(("tokens", "7d"), ("1 rank s", "9.3f"), ("CP2 s", "7.3f"), ("speed-up", "8.2f"),
                  ("1 rank cpu s", "12.3f"), ("CP2 cpu s", "9.3f"), ("cpu speed-up", "12.2f"),
                  ("saved MB 1", "10.1f"), ("saved MB/rank 2", "15.1f"), ("ratio", "6.2f"),
                  ("CP vs 1 rank", "12.1e"))  # fmt: skip
    table.header()
    rows = []
    for seq, one, two in one_and_two_ranks(jamba_cp_job, lengths, repeats):
        t1 = statistics.median(one["seconds"])
        t2 = statistics.median(max(r["seconds"][i] for r in two) for i in range(repeats))
        c1 = statistics.median(one["cpu"])
        c2 = statistics.median(max(r["cpu"][i] for r in two) for i in range(repeats))
        s2 = max(r["saved"] for r in two)
        cp_out = torch.cat([r["out"] for r in two], 1)
        err = float((cp_out - one["out"]).abs().max() / one["out"].abs().max())
        row = dict(tokens=seq, single_s=t1, cp2_s=t2, speedup=t1 / t2, single_cpu_s=c1,
                   cp2_cpu_s=c2, cpu_speedup=c1 / c2, saved_single=one["saved"],
                   saved_cp2=s2, saved_ratio=one["saved"] / s2, cp_error=err)  # fmt: skip
        rows.append(row)
        table.row(seq, t1, t2, row["speedup"], c1, c2, row["cpu_speedup"], one["saved"] / 2**20,
                  s2 / 2**20, row["saved_ratio"], err)  # fmt: skip
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--flat-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--skip-transformers-above", type=int, default=4096,
                   help="time transformers' side only up to this many tokens")
    p.add_argument("--skip-mamba1-transformers-above", type=int, default=2048,
                   help="the same for mamba1: transformers' per-token loop indexes [B, I, L, N] "
                        "tensors, whose backward writes a full-size gradient per token (quadratic "
                        "in L: minutes at 4096 tokens)")
    p.add_argument("--cp-lengths", type=int, nargs="*", default=[8192],
                   help="part 2's row lengths (none: skip part 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heap", action="store_true",
                   help="glibc heap only (no fresh mmap per large block; see bench_gla.py)")
    args = p.parse_args(argv)
    if args.heap:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 2**40)  # M_TRIM_THRESHOLD
    return with_threads(args.threads, _run, args)


def _run(args) -> dict:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch 1, fp32, one "
          f"document per row; forward + backward CPU time, median of {args.repeats}"
          f"{', heap-only allocator' if args.heap else ''}")
    limit = dict.fromkeys(CASES, args.skip_transformers_above)
    limit["mamba1"] = min(limit["mamba1"], args.skip_mamba1_transformers_above)
    ops = {name: compare(name, args.lengths, args.flat_lengths, args.repeats, limit[name])
           for name in args.ops}  # fmt: skip
    cp = jamba_cp(args.cp_lengths, args.repeats) if args.cp_lengths else []
    return dict(ops=ops, cp=cp)


if __name__ == "__main__":
    main()
