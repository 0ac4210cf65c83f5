"""Inputs and per-rank jobs for the index attention and indexer tests (importable by RankPool).

Every job receives the *global* tensors, slices its own contiguous interval, runs one operator
(or an indexer feeding index attention) under CP and returns plain tensors; the tests compare
them with the single-process operator and with the references.

Operators (``name``):

* ``"attn"``: ``index_attention(q, k, v, indices, ctx, kv="local")`` (GQA);
* ``"attn_global"``: the MLA route: the job all-gathers k/v itself and calls ``kv="global"``;
* ``"kpool"``: ``kpool_indexer`` (returns the indices); ``"qsa"``: ``qsa_indexer``;
* ``"glm"``: ``kpool_indexer`` -> ``index_attention`` (per-head keys, ``kv="global"``);
* ``"qsa_attn"``: ``qsa_indexer`` -> ``index_attention`` (GQA, ``kv="local"``).
"""

from __future__ import annotations

import pytest
import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.index_attention import index_attention
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.kit.norms import rope_tables
from fcp.ops.qsa_indexer import qsa_indexer

ATTENTION_OPS = ("attn", "attn_global", "glm", "qsa_attn")
INDEXER_OPS = ("kpool", "qsa")
OPS = ATTENTION_OPS + INDEXER_OPS
QKV = ("q", "k", "v")
#: tensors that are not per token (never sliced by rank)
PARAMS = ("ape", "q_norm", "k_norm")
ROTARY = 4  # QSA RoPE width (of index_dim)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes run fastest on one intra-op thread; with two threads on a busy 2-core machine
    every parallel region waits for a descheduled thread (milliseconds per small op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_inputs(
    seed: int,
    batch: int,
    seq: int,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 8,
    dv: int = 6,
    width: int = 6,
    index_heads: int = 2,
    index_dim: int = 8,
    kpool: int = 4,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Global random inputs of every operator (CPU). ``indices`` hold ids in ``[-2, seq + 1]``:
    -1, out-of-range, future and other-document ids included (the operator must drop them)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return {
        "q": r(batch, seq, heads, dim),
        "k": r(batch, seq, kv_heads, dim),
        "v": r(batch, seq, kv_heads, dv),
        "indices": torch.randint(-2, seq + 2, (batch, seq, width), generator=g),
        "index_q": r(batch, seq, index_heads, index_dim),
        "index_k": r(batch, seq, index_dim),
        "gate_logits": r(batch, seq, index_dim),
        "ape": r(kpool, index_dim, s=0.5),
        "head_weights": r(batch, seq, index_heads),
        "q_norm": r(index_dim, s=0.3),
        "k_norm": r(index_dim, s=0.3),
    }


def _rope(ctx: PackedContext, dtype):
    cos, sin = rope_tables(ctx.position_ids, ROTARY, dtype=dtype)  # document-local positions
    return cos[:, ctx.seq_start : ctx.seq_end], sin[:, ctx.seq_start : ctx.seq_end]


def call_op(name: str, t: dict, ctx: PackedContext, kw: dict) -> torch.Tensor:
    """Run operator ``name`` on this rank's tensors ``t``; ``kw`` holds its options."""
    attn_kw = {n: kw[n] for n in ("scale", "query_chunk") if n in kw}
    if name == "attn":
        return index_attention(t["q"], t["k"], t["v"], t["indices"], ctx, **attn_kw)
    if name == "attn_global":
        k, v = all_gather_sequence(t["k"], ctx), all_gather_sequence(t["v"], ctx)
        return index_attention(t["q"], k, v, t["indices"], ctx, kv="global", **attn_kw)
    if name in ("kpool", "glm"):
        idx = kpool_indexer(t["index_q"], t["index_k"], t["gate_logits"], t["ape"],
                            t["head_weights"], ctx, topk=kw.get("topk", 8),
                            kpool=kw.get("kpool", 4), select_tail=kw.get("select_tail", True),
                            query_chunk=kw.get("query_chunk"))
        if name == "kpool":
            return idx
        q = t["q"]  # MLA layout: per-head keys (kv_heads == heads), gathered by the caller
        heads = q.shape[2]
        k = all_gather_sequence(t["k"], ctx).repeat_interleave(heads // t["k"].shape[2], 2)
        v = all_gather_sequence(t["v"], ctx).repeat_interleave(heads // t["v"].shape[2], 2)
        return index_attention(q, k, v, idx, ctx, kv="global", **attn_kw)
    if name in ("qsa", "qsa_attn"):
        cos, sin = _rope(ctx, t["index_q"].dtype)
        idx = qsa_indexer(t["index_q"], t["index_k"], t["q_norm"], t["k_norm"], cos, sin, ctx,
                          budget=kw.get("budget", 8), ratio=kw.get("ratio", 4),
                          query_chunk=kw.get("query_chunk"))  # fmt: skip
        if name == "qsa":
            return idx
        return index_attention(t["q"], t["k"], t["v"], idx, ctx, **attn_kw)
    raise ValueError(name)


def local_inputs(inputs: dict, sl: slice) -> dict:
    return {n: (x if n in PARAMS else x[:, sl]).clone() for n, x in inputs.items()}


def forward_backward(name, inputs, ctx, kw, grad_out, sl=slice(None)):
    """``{"out": ..., "q"/"k"/"v": grads}`` (attention) or ``{"out": indices}`` (indexers)."""
    t = local_inputs(inputs, sl)
    if name in INDEXER_OPS:
        return {"out": call_op(name, t, ctx, kw)}
    for n in QKV:
        t[n].requires_grad_()
    out = call_op(name, t, ctx, kw)
    (out.float() * grad_out[:, sl]).sum().backward()
    return {"out": out.detach(), **{n: t[n].grad for n in QKV}}


def single_process(name, inputs, doc_ids, kw, grad_out):
    return forward_backward(name, inputs, PackedContext(doc_ids), kw, grad_out)


def cp_context(env, doc_ids) -> PackedContext:
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def cp_rank(env, name, inputs, doc_ids, kw, grad_out):
    """One rank of a CP run: this rank's output (and q/k/v gradients)."""
    ctx = cp_context(env, doc_ids)
    return forward_backward(name, inputs, ctx, kw, grad_out, slice(ctx.seq_start, ctx.seq_end))


def cp_rank_pair(env, name, inputs_a, inputs_b, doc_ids, kw, grad_a, grad_b):
    """Two CP runs on the same ranks (e.g. clean and perturbed): both results."""
    return (cp_rank(env, name, inputs_a, doc_ids, kw, grad_a),
            cp_rank(env, name, inputs_b, doc_ids, kw, grad_b))  # fmt: skip


def cp_bytes_rank(env, name, inputs, doc_ids, kw) -> int:
    """Bytes this rank receives from collectives in one forward of ``name`` (eager)."""
    from examples.comm_accounting import CommBytes

    ctx = cp_context(env, doc_ids)
    t = local_inputs(inputs, slice(ctx.seq_start, ctx.seq_end))
    with torch.no_grad(), CommBytes(env.rank, env.world_size) as comm:
        call_op(name, t, ctx, kw)
    return comm.received


# ------------------------------------------------------------------------------ compile
FORBIDDEN_OPS = ("_local_scalar_dense", "aten.nonzero", "aten.item")


def recording_backend(graphs: list):
    """``aot_eager`` rebuilt from its parts, recording the forward and backward aten graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def compile_packings(name, inputs, doc_ids_list, kw, grad_out, ctx_fn):
    """Compile ``name`` once (``fullgraph=True``, aot_eager) and run it over many packings.

    Returns ``(frame_count, forbidden aten ops found, max |compiled - eager|, graphs)`` over
    outputs (and q/k/v gradients for attention operators; indices must be equal).
    """
    import torch._dynamo.testing

    torch._dynamo.reset()
    graphs: list[str] = []
    counter = torch._dynamo.testing.CompileCounterWithBackend(recording_backend(graphs))

    def op(t, ctx):
        return call_op(name, t, ctx, kw)

    compiled = torch.compile(op, backend=counter, fullgraph=True)
    worst = 0.0
    for doc_ids in doc_ids_list:
        ctx = ctx_fn(doc_ids)
        sl = slice(ctx.seq_start, ctx.seq_end)
        results = []
        for fn in (op, compiled):
            t = local_inputs(inputs, sl)
            if name in INDEXER_OPS:
                results.append([fn(t, ctx)])
                continue
            for n in QKV:
                t[n].requires_grad_()
            out = fn(t, ctx)
            (out.float() * grad_out[:, sl]).sum().backward()
            results.append([out.detach()] + [t[n].grad for n in QKV])
        for a, b in zip(*results):
            if a.dtype == torch.int64:
                worst = max(worst, 0.0 if torch.equal(a, b) else float("inf"))
            else:
                worst = max(worst, (a.float() - b.float()).abs().max().item())
    found = sorted({o for g in graphs for o in FORBIDDEN_OPS if o in g})
    return counter.frame_count, found, worst, len(graphs)


def cp_compile_rank(env, name, inputs, doc_ids_list, kw, grad_out):
    return compile_packings(name, inputs, doc_ids_list, kw, grad_out,
                            lambda d: cp_context(env, d))  # fmt: skip
