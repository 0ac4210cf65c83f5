"""One Mamba2 hybrid layer (transformers' Nemotron-H Mamba2 mixer on fcp) under CP: 2 vs 1 rank.

    .venv/bin/python -m benchmarks.bench_mamba2_cp [--lengths 8192] [--repeats 3]

transformers' ``NemotronHMamba2Mixer`` (in-projection, conv over ``[x | B | C]``, SSD by
:func:`fcp.ops.gla.gla`, D skip, gated RMSNorm, out-projection), made packed and CP by
:func:`fcp.integrations.hf.enable_packed_cp`, forward + backward on one packed row of random
documents (fp32, one thread per rank). Reported: the slowest rank's median wall time with CP 2
and with 1 rank and the speed-up; the same for the CPU time each rank's process spends
(``time.process_time``: the work per rank, i.e. the speed-up where each rank has its own core,
unaffected by other processes on a shared machine); the bytes of activations each rank saves
for the backward (counted by a ``saved_tensors_hooks``, as ``bench_scaling.py`` does: the
memory CP divides); and the largest difference of the CP output from the single-process one
(relative to its largest entry). The layer's shapes are Nemotron-H's scaled down for a CPU
(hidden 256, 8 heads of 32, 2 groups, state 64, conv 4, the model's chunks of 128 tokens, fcp's
of 64); under CP it exchanges a 3-token conv halo and one fp32 state-chain all-gather of
``[1, 8, 64, 96]`` per call. gloo ranks share the machine's cores: read the wall-time speed-up
as a lower bound; the memory ratio is exact.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fcp
from benchmarks.common import Table, one_and_two_ranks, rank_times, saved_bytes

SHAPES = dict(hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
              ssm_state_size=64, conv_kernel=4, chunk_size=128)  # fmt: skip


def _layer():
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from fcp.integrations.hf import enable_packed_cp

    torch.manual_seed(0)
    config = NemotronHConfig(layers_block_type=["linear_attention"], **SHAPES)
    return enable_packed_cp(NemotronHMamba2Mixer(config, layer_idx=0))


def _doc_ids(seq: int) -> torch.Tensor:
    """One row of random documents of 64 .. seq / 3 tokens (the last one cut at ``seq``)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, max(65, seq // 3), (1, 64), generator=gen)
    lens = torch.where(lens.cumsum(1) > seq, torch.full_like(lens, -1000), lens)
    return fcp.doc_ids_from_seq_lens(lens, seq)


def cp_job(env, seq: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    layer = _layer()
    group = env.group if env.world_size > 1 else None
    ctx = fcp.PackedContext(_doc_ids(seq), group=group, cp_size=env.world_size, cp_rank=env.rank)
    x_full = torch.randn(1, seq, SHAPES["hidden_size"], generator=torch.Generator().manual_seed(1))
    x = ctx.shard(x_full).requires_grad_()

    def step():
        out = layer(x, cp_context=ctx)
        out.pow(2).mean().backward()
        return out

    out, saved = saved_bytes(step)  # also the warm-up
    times, cpu = rank_times(step, layer, repeats, group)
    return dict(seconds=times, cpu=cpu, saved=saved, out=out.detach())


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    print("# transformers' Nemotron-H Mamba2 mixer on fcp, one packed row, fwd+bwd, fp32: "
          "CP 2 vs 1 rank")  # fmt: skip
    table = Table(("tokens", "7d"), ("1 rank s", "9.3f"), ("CP2 s", "7.3f"), ("speed-up", "8.2f"),
                  ("1 rank cpu s", "12.3f"), ("CP2 cpu s", "9.3f"), ("cpu speed-up", "12.2f"),
                  ("saved MB 1", "10.1f"), ("saved MB/rank 2", "15.1f"), ("ratio", "6.2f"),
                  ("CP vs 1 rank", "12.1e"))  # fmt: skip
    table.header()
    for seq, one, two in one_and_two_ranks(cp_job, args.lengths, args.repeats):
        t1 = statistics.median(one["seconds"])
        t2 = statistics.median(max(r["seconds"][i] for r in two) for i in range(args.repeats))
        c1 = statistics.median(one["cpu"])
        c2 = statistics.median(max(r["cpu"][i] for r in two) for i in range(args.repeats))
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


if __name__ == "__main__":
    main()
