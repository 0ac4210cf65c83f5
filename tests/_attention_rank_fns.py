"""Per-rank jobs of the attention-family tests (importable by module path for RankPool).

Every job receives the *global* tensors, slices its own contiguous interval, runs one operator
under CP and returns plain tensors (:mod:`tests.support.cp_jobs`); the tests compare them with
the single-process operator and with the float64 references. Operators (``name``):

* ``"doc_causal"``, ``"compressed"``, ``"sliding"``: document-causal, compressed and
  sliding-window softmax attention (``"sliding"``'s window: ``kw["window"]``, default
  :data:`WINDOW`); with an input ``"sinks"`` (``[batch, seq, heads]``, per token, differentiated
  like q/k/v) ``"doc_causal"`` and ``"sliding"`` pass it as their attention sinks;
* ``"attn"``: ``index_attention(q, k, v, indices, ctx, kv="local")`` (GQA);
* ``"attn_global"``: the MLA route: the job all-gathers k/v itself and calls ``kv="global"``;
* ``"kpool"``: ``kpool_indexer`` (returns the indices); ``"qsa"``: ``qsa_indexer``;
* ``"glm"``: ``kpool_indexer`` -> ``index_attention`` (per-head keys, ``kv="global"``);
* ``"qsa_attn"``: ``qsa_indexer`` -> ``index_attention`` (GQA, ``kv="local"``).

Inputs: :func:`tests.support.inputs.attention_inputs` / :func:`~tests.support.inputs.index_inputs`.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.compressed import compressed_attention
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.index_attention import index_attention
from fcp.ops.kit.norms import rope_tables
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.kpool_indexer.reference import kpool_indexer_reference
from fcp.ops.qsa_indexer import qsa_indexer
from fcp.ops.qsa_indexer.reference import qsa_indexer_reference
from fcp.ops.sliding_window import sliding_window_attention
from tests.support import cp_jobs
from tests.support.inputs import QKV

SOFTMAX_OPS = ("doc_causal", "compressed", "sliding")
#: ``"sliding"``'s default window: longer than a 4-rank shard of the CP tests (4 tokens), shorter
#: than their documents
WINDOW = 6
INDEX_OPS = ("attn", "attn_global", "glm", "qsa_attn")
INDEXER_OPS = ("kpool", "qsa")
#: index_inputs' tensors that are not per token (never sliced by rank)
PARAMS = ("ape", "q_norm", "k_norm")
#: the k-pool indexer's tensor arguments, in call order
KPOOL_INPUTS = ("index_q", "index_k", "gate_logits", "ape", "head_weights")
ROTARY = 4  # QSA RoPE width (of index_dim)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes run fastest on one intra-op thread; with two threads on a busy 2-core machine
    every parallel region waits for a descheduled thread (milliseconds per small op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rope(ctx: PackedContext, dtype):
    cos, sin = rope_tables(ctx.position_ids, ROTARY, dtype=dtype)  # document-local positions
    return cos[:, ctx.seq_start : ctx.seq_end], sin[:, ctx.seq_start : ctx.seq_end]


def call_op(name: str, t: dict, ctx: PackedContext, kw: dict) -> torch.Tensor:
    """Run operator ``name`` on this rank's tensors ``t``; ``kw`` holds its options."""
    if name == "doc_causal":
        return doc_causal_attention(t["q"], t["k"], t["v"], ctx, sinks=t.get("sinks"), **kw)
    if name == "sliding":
        kw = {"window": WINDOW, **kw}
        return sliding_window_attention(t["q"], t["k"], t["v"], ctx, sinks=t.get("sinks"), **kw)
    if name == "compressed":
        return compressed_attention(t["q"], t["k"], t["v"], ctx, **kw)
    attn_kw = {n: kw[n] for n in ("scale", "query_chunk") if n in kw}
    if name == "attn":
        return index_attention(t["q"], t["k"], t["v"], t["indices"], ctx, **attn_kw)
    if name == "attn_global":
        k, v = all_gather_sequence(t["k"], ctx), all_gather_sequence(t["v"], ctx)
        return index_attention(t["q"], k, v, t["indices"], ctx, kv="global", **attn_kw)
    if name in ("kpool", "glm"):
        idx = kpool_indexer(*(t[n] for n in KPOOL_INPUTS), ctx, topk=kw.get("topk", 8),
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


def _call(name: str, kw: dict):
    def call(t, ctx):
        return call_op(name, t, ctx, kw)

    return call


def _names(name: str, inputs: dict) -> dict:
    """What :mod:`cp_jobs` differentiates (q/k/v and sinks; nothing for an indexer) and leaves
    whole."""
    if name in INDEXER_OPS:
        return dict(grads=(), params=PARAMS)
    return dict(grads=QKV + (("sinks",) if "sinks" in inputs else ()), params=PARAMS)


def single_process(name, inputs, doc_ids, kw, grad_out):
    """``{"out": ..., "q"/"k"/"v": grads}`` (attention) or ``{"out": indices}`` (indexers)."""
    ctx = PackedContext(doc_ids)
    return cp_jobs.forward_backward(_call(name, kw), inputs, ctx, grad_out, **_names(name, inputs))


def run_in(name, inputs, ctx, kw, grad_out):
    """``name`` on this rank's slice of ``inputs`` under ``ctx``: out (and q/k/v gradients)."""
    return cp_jobs.forward_backward(_call(name, kw), inputs, ctx, grad_out, cp_jobs.shard(ctx),
                                    **_names(name, inputs))  # fmt: skip


def cp_rank(env, name, inputs, doc_ids, kw, grad_out):
    """One rank of a CP run: this rank's output (and q/k/v gradients)."""
    ctx = cp_jobs.cp_context(env, doc_ids)
    return cp_jobs.forward_backward(_call(name, kw), inputs, ctx, grad_out, cp_jobs.shard(ctx),
                                    **_names(name, inputs))  # fmt: skip


def cp_rank_pair(env, name, inputs_a, inputs_b, doc_ids, kw, grad_a, grad_b):
    """Two CP runs on the same ranks (e.g. clean and perturbed): both results."""
    return (cp_rank(env, name, inputs_a, doc_ids, kw, grad_a),
            cp_rank(env, name, inputs_b, doc_ids, kw, grad_b))  # fmt: skip


def cp_error(env, name, inputs, doc_ids, kw):
    """The ValueError message a CP call raises (``None`` if it does not raise)."""
    ctx = cp_jobs.cp_context(env, doc_ids)
    try:
        call_op(name, cp_jobs.leaves(inputs, cp_jobs.shard(ctx), params=PARAMS), ctx, kw)
    except ValueError as e:
        return str(e)
    return None


def cp_bytes_rank(env, name, inputs, doc_ids, kw) -> int:
    """Bytes this rank receives from collectives in one forward of ``name`` (eager)."""
    from examples.comm_accounting import CommBytes

    ctx = cp_jobs.cp_context(env, doc_ids)
    t = cp_jobs.leaves(inputs, cp_jobs.shard(ctx), params=PARAMS)
    with torch.no_grad(), CommBytes(env.rank, env.world_size) as comm:
        call_op(name, t, ctx, kw)
    return comm.received


def compile_packings(name, inputs, doc_ids_list, kw, grad_out, ctx_fn):
    """:func:`cp_jobs.compile_packings` of operator ``name``: ``(frames, host syncs found,
    max |compiled - eager|, graphs recorded)``."""
    return cp_jobs.compile_packings(_call(name, kw), inputs, doc_ids_list, grad_out, ctx_fn,
                                    **_names(name, inputs))  # fmt: skip


def cp_compile_rank(env, name, inputs, doc_ids_list, kw, grad_out):
    return compile_packings(name, inputs, doc_ids_list, kw, grad_out,
                            functools.partial(cp_jobs.cp_context, env))


# ---------------------------------------------------------------------------------------------
# test process: the comparison every CP test makes, the indexers' references
# ---------------------------------------------------------------------------------------------
def check_cp(rank_pool, name, world, inputs, doc_ids, kw, grad_out, tol) -> list:
    """CP on ``world`` ranks equals one process: outputs and q/k/v gradients within ``tol``
    (``assert_close`` keywords) in the same dtype, the indexers' ids bitwise. Returns the
    ranks' results."""
    want = single_process(name, inputs, doc_ids, kw, grad_out)
    res = rank_pool.run(cp_rank, world, name, inputs, doc_ids, kw, grad_out)
    for key in want:
        got = cp_jobs.cat_ranks(res, key)
        if name in INDEXER_OPS:
            assert torch.equal(got, want[key]), name
            continue
        assert got.dtype == want[key].dtype, (name, key)
        torch.testing.assert_close(got.float(), want[key].float(), **tol, msg=f"{name} {key}")
    return res


def reference_ids(name: str, inputs: dict, doc_ids: torch.Tensor, kw: dict):
    """``(ids, near, exact)`` of indexer ``name``'s float64 reference on the global inputs."""
    if name == "kpool":
        return kpool_indexer_reference(*(inputs[n] for n in KPOOL_INPUTS), doc_ids, **kw)
    pos = PackedContext(doc_ids).position_ids
    cos, sin = rope_tables(pos, ROTARY, dtype=inputs["index_q"].dtype)
    return qsa_indexer_reference(inputs["index_q"], inputs["index_k"], inputs["q_norm"],
                                 inputs["k_norm"], cos, sin, doc_ids, **kw)  # fmt: skip
