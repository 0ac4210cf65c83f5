"""Index attention: time per token at growing sequence lengths (flat), and CP bytes per layer.

    .venv/bin/python benchmarks/bench_index_attention.py [--lengths 2048 8192 32768]
                                                         [--repeats 3] [--doc-len 2048]

1. Forward + backward time of :func:`fcp.index_attention` per token, single process, one
   intra-op thread (median of ``repeats``), on selections made by the real indexers:

   * ``glm``: GLM-5.3-Flash-shaped: :func:`fcp.kpool_indexer` (pools of 4, 128 tokens from
     complete pools + a 3-token tail: ``W = 131``), MLA head layout (4 heads with their own
     keys and values, D = Dv = 32, ``kv="global"``);
   * ``qsa``: Qwen3.8-Flash-Next-shaped: :func:`fcp.qsa_indexer` (blocks of 4, budget 128,
     ``W = 131``), GQA 8 query heads on 2 KV heads, D = Dv = 32 (``kv="local"``).

   Rows are packed with documents of ``--doc-len`` tokens (the same per-token work at every
   length), so a flat time per token shows that the cost does not grow with the sequence (no
   ``L x S`` score or mask). The selections are computed once per length, outside the timing;
   lengths are timed round-robin, so load on a shared machine hits all of them alike.
2. Bytes each rank receives per layer under CP (bf16, 4 ranks, 32k tokens per rank), from the
   shapes of the released configurations: what fcp gathers versus a full K/V all-gather.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fcp.context import PackedContext
from fcp.layout import doc_ids_from_seq_lens
from fcp.ops.index_attention import index_attention
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.kit.norms import rope_tables
from fcp.ops.qsa_indexer import qsa_indexer

SHAPES = {
    "glm": dict(heads=4, kv_heads=4, dim=32, dv=32, kv="global"),
    "qsa": dict(heads=8, kv_heads=2, dim=32, dv=32, kv="local"),
}
POOL, TOPK, INDEX_HEADS, INDEX_DIM = 4, 128, 4, 32


def selection(kind: str, tokens: int, doc_len: int, g: torch.Generator) -> torch.Tensor:
    """Global ids ``[1, tokens, W]`` from the real indexer, run on each document alone (the
    same ids as on the packed row; documents batched as rows to bound the scorer's memory)."""
    docs = tokens // doc_len
    ctx = PackedContext(torch.ones(docs, doc_len, dtype=torch.long))

    def r(*shape):
        return torch.randn(docs, doc_len, *shape, generator=g)

    if kind == "glm":
        ids = kpool_indexer(r(INDEX_HEADS, INDEX_DIM), r(INDEX_DIM), r(INDEX_DIM),
                            torch.randn(POOL, INDEX_DIM, generator=g) * 0.5, r(INDEX_HEADS),
                            ctx, topk=TOPK, kpool=POOL)  # fmt: skip
    else:
        cos, sin = rope_tables(ctx.position_ids, 16)
        ids = qsa_indexer(r(INDEX_HEADS, INDEX_DIM), r(INDEX_DIM), torch.zeros(INDEX_DIM),
                          torch.zeros(INDEX_DIM), cos, sin, ctx, budget=TOPK, ratio=POOL)
    offset = (torch.arange(docs) * doc_len)[:, None, None]
    ids = torch.where(ids >= 0, ids + offset, -1)
    return ids.reshape(1, tokens, ids.shape[-1])


def prepare(kind: str, tokens: int, doc_len: int):
    """``(step, row)``: one fwd+bwd of index attention on a ``tokens``-long row, and its facts."""
    g = torch.Generator().manual_seed(0)
    shape = SHAPES[kind]
    ids = selection(kind, tokens, doc_len, g)
    doc_ids = doc_ids_from_seq_lens(torch.full((1, tokens // doc_len), doc_len), tokens)
    ctx = PackedContext(doc_ids)
    q = torch.randn(1, tokens, shape["heads"], shape["dim"], generator=g)
    k = torch.randn(1, tokens, shape["kv_heads"], shape["dim"], generator=g)
    v = torch.randn(1, tokens, shape["kv_heads"], shape["dv"], generator=g)
    grad = torch.randn(1, tokens, shape["heads"], shape["dv"], generator=g)

    def step():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = index_attention(*leaves, ids, ctx, kv=shape["kv"])
        out.backward(grad)

    valid = float((ids >= 0).sum(-1).float().mean())
    return step, dict(kind=kind, tokens=tokens, width=ids.shape[-1], valid=valid)


def time_per_token(kind: str, lengths: list[int], doc_len: int, repeats: int) -> list[dict]:
    """Median fwd+bwd time per token at each length, timed round-robin over the lengths so that
    load from other processes on a shared machine hits every length alike."""
    cases = [prepare(kind, tokens, doc_len) for tokens in lengths]
    for step, _ in cases:
        step()  # warm-up: allocator and first-call overheads
    times = [[] for _ in cases]
    for _ in range(repeats):
        for (step, _), ts in zip(cases, times):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
    rows = []
    for (_, row), ts in zip(cases, times):
        n = row["tokens"]
        rows.append(dict(row, us_per_token=statistics.median(ts) / n * 1e6,
                         spread=(min(ts) / n * 1e6, max(ts) / n * 1e6)))  # fmt: skip
    return rows


def cp_bytes(world: int = 4, local: int = 32768, elem: int = 2) -> list[dict]:
    """Bytes one rank receives per layer (forward) under CP, from the released shapes."""
    others = (world - 1) * local * elem
    rows = []
    # GLM-5.3-Flash (transformers defaults): 64 heads, qk 256 + v 256 per head, KV latent 512;
    # indexer head dim 128, pools of 4 (the released checkpoint's index_kpool); halo: 3 tokens.
    full = others * 64 * (256 + 256)
    latent = others * 512
    pooled = (world - 1) * (local // 4) * 128 * elem
    halo = 3 * 2 * 128 * elem
    rows.append(dict(model="GLM-5.3-Flash DSA (MLA)", fcp=latent + pooled + halo, full_kv=full,
                     what="KV latent + pooled index keys + 3-token halo"))  # fmt: skip
    # Qwen3.8-Flash-Next QSA: 2 KV heads of 256 (K and V); indexer head dim 128, blocks of 4,
    # RoPE width 64 (halo of 3 tokens of raw index key + cos/sin).
    kv = others * 2 * 2 * 256
    compressed = (world - 1) * (local // 4) * 128 * elem
    halo = 3 * (128 + 64) * elem
    nemo_indexer = others * (128 + 64)  # NeMo's packed CP path: raw index keys + freqs, all tokens
    rows.append(dict(model="Qwen3.8-Flash-Next QSA (GQA)", fcp=kv + compressed + halo,
                     full_kv=kv, nemo=kv + nemo_indexer,
                     what="K/V (2 heads) + compressed index keys + 3-token halo"))  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--doc-len", type=int, default=2048)
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        print(f"# index attention fwd+bwd per token, 1 thread, fp32, documents of "
              f"{args.doc_len} tokens (median of {args.repeats}; min..max)")
        print(f"{'shape':>5} {'tokens':>7} {'W':>4} {'ids/query':>9} {'us/token':>9}  spread")
        for kind in SHAPES:
            kind_rows = time_per_token(kind, args.lengths, args.doc_len, args.repeats)
            rows += kind_rows
            for r in kind_rows:
                print(f"{kind:>5} {r['tokens']:7d} {r['width']:4d} {r['valid']:9.1f} "
                      f"{r['us_per_token']:9.2f}  {r['spread'][0]:.2f}..{r['spread'][1]:.2f}",
                      flush=True)  # fmt: skip
            base, last = kind_rows[0], kind_rows[-1]
            print(f"{kind:>5} per-token time {last['tokens']} / {base['tokens']} tokens: "
                  f"{last['us_per_token'] / base['us_per_token']:.2f}x")
    finally:
        torch.set_num_threads(threads)
    print("\n# bytes received per rank per layer under CP (bf16, 4 ranks x 32k tokens, forward)")
    for r in cp_bytes():
        extra = f"; NeMo's packed CP path {r['nemo'] / 2**20:.1f} MiB" if "nemo" in r else ""
        print(f"{r['model']}: fcp {r['fcp'] / 2**20:.1f} MiB ({r['what']}) vs full K/V "
              f"{r['full_kv'] / 2**20:.1f} MiB = {r['fcp'] / r['full_kv']:.3f}{extra}")
    return rows


if __name__ == "__main__":
    main()
