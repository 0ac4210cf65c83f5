"""transformers' GLM-5.3-Flash on fcp under CP: time, saved activations and bytes per rank.

    .venv/bin/python -m benchmarks.bench_glm5_cp [--lengths 1024 4096] [--repeats 3]

1. The demo's model (``examples/configs/glm5_next_tiny.json``, mixers on fcp) forward + backward
   on one packed row, with CP 2 against 1 rank: the slowest rank's median time and the bytes of
   activations each rank saves for the backward (the memory CP divides). gloo ranks share the
   machine's cores: read times as an upper bound, the memory ratio is exact.
2. Bytes each rank receives per DSA (indexed MLA) layer in the forward, measured by counting the
   collectives (:class:`examples.comm_accounting.CommBytes`), next to what gathering the expanded
   K/V or the hidden states (NeMo's choice) would move; and the same three numbers for the
   released model's shapes (transformers' defaults: 64 heads, K 256 + V 256 per head, KV latent
   512, hidden 4096, index keys 128 per pool of 16 tokens; bf16, 4 ranks x 32k tokens).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fcp
from benchmarks.common import Table, one_and_two_ranks, rank_times, saved_bytes
from examples.comm_accounting import CommBytes
from examples.data import PackedDocuments
from examples.glm5_hf import Glm5NextLM


def train_step(model, local, ctx):
    """Forward, token-summed cross-entropy, backward: the demo step without FSDP and optimizer."""
    logits = model(local["input_ids"], ctx)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), local["shift_labels"].flatten(),
                                             ignore_index=-100, reduction="sum")  # fmt: skip
    loss.backward()


def cp_job(env, seq: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    model = Glm5NextLM.from_config()
    batch = PackedDocuments(seq, 1, seed=0).batches(1)[0]
    group = env.group if env.world_size > 1 else None
    local, ctx = fcp.shard_batch(group, batch)
    _, saved = saved_bytes(lambda: train_step(model, local, ctx))
    times, _ = rank_times(lambda: train_step(model, local, ctx), model, repeats, group)
    # bytes received by one DSA layer's forward: its mixer alone, on this rank's input
    dsa = model.backbone.layers[3].self_attn
    x = torch.randn(1, ctx.local_seq_len, model.config.hidden_size)
    with torch.no_grad(), CommBytes(ctx.cp_rank, ctx.cp_size) as comm:
        dsa(x, cp_context=ctx)
    return dict(seconds=statistics.median(times), saved=saved, dsa_received=comm.received)


def layer_bytes(cfg, world: int, local: int, elem: int) -> dict:
    """Bytes one rank receives per DSA layer (forward) for three ways to get what it needs."""
    others = (world - 1) * local * elem
    heads = cfg["num_attention_heads"]
    return dict(
        expanded_kv=others * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
        hidden=others * cfg["hidden_size"],
        latent_and_pools=others * cfg["kv_lora_rank"]
        + (world - 1) * (local // cfg["index_kpool"]) * cfg["index_head_dim"] * elem,
    )


RELEASED = dict(num_attention_heads=64, qk_nope_head_dim=256, v_head_dim=256, kv_lora_rank=512,
                hidden_size=4096, index_kpool=16, index_head_dim=128)  # fmt: skip


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import json

    from examples.glm5_hf import CONFIG

    cfg = json.loads(CONFIG.read_text())
    rows = []
    print("# the demo's GLM-5.3-Flash, one packed row, fwd+bwd: CP 2 vs 1 rank")
    table = Table(("tokens", "7d"), ("1 rank s", "9.3f"), ("CP2 s", "7.3f"), ("speed-up", "8.2f"),
                  ("saved MB 1", "10.1f"), ("saved MB/rank 2", "15.1f"), ("ratio", "6.2f"),
                  ("DSA bytes/rank", "14d"), ("expanded K/V", "12d"), ("hidden", "8d"))
    table.header()
    for seq, one, two in one_and_two_ranks(cp_job, args.lengths, args.repeats):
        t2 = max(r["seconds"] for r in two)
        s2 = max(r["saved"] for r in two)
        got = max(r["dsa_received"] for r in two)
        alt = layer_bytes(cfg, 2, seq // 2, 4)
        row = dict(tokens=seq, single_s=one["seconds"], cp2_s=t2, speedup=one["seconds"] / t2,
                   saved_ratio=one["saved"] / s2, dsa_bytes=got, **alt)  # fmt: skip
        rows.append(row)
        table.row(seq, one["seconds"], t2, row["speedup"], one["saved"] / 2**20, s2 / 2**20,
                  row["saved_ratio"], got, alt["expanded_kv"], alt["hidden"])  # fmt: skip
    big = layer_bytes(RELEASED, 4, 32768, 2)
    print("# released shapes, 4 ranks x 32k tokens, bf16, per DSA layer per rank (forward): "
          f"latent + pooled index keys {big['latent_and_pools'] / 2**20:.0f} MiB, expanded K/V "
          f"{big['expanded_kv'] / 2**20:.0f} MiB, hidden states {big['hidden'] / 2**20:.0f} MiB")
    rows.append(dict(tokens=None, released=big))
    return rows


if __name__ == "__main__":
    main()
