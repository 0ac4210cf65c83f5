"""Functions run on pool ranks by the latent-attention tests (importable by module path)."""

from __future__ import annotations

import functools

import torch

from fcp.ops.latent_attention import latent_attention
from tests.support import cp_jobs

#: inputs that are not per token: whole on every rank (their gradients are per-rank partial sums)
PARAMS = ("kv_weight", "kv_bias")
GRADS = ("q", "latent", "kv_weight", "kv_bias", "k_rope")


def call(t: dict, ctx, scale: float | None = None, query_chunk: int | None = None):
    return latent_attention(t["q"], t["latent"], t["kv_weight"], t["indices"], ctx,
                            kv_bias=t.get("kv_bias"), k_rope=t.get("k_rope"), scale=scale,
                            query_chunk=query_chunk)  # fmt: skip


def run(inputs: dict, ctx, grad_out: torch.Tensor, scale=None, query_chunk=None) -> dict:
    """``{"out", "q", "latent", "kv_weight", "kv_bias"}`` (the last two: this rank's partial
    sums) for ``sum(out * grad_out)`` on ``ctx``'s interval of the global ``inputs``."""
    grads = tuple(n for n in GRADS if n in inputs)
    return cp_jobs.forward_backward(functools.partial(call, scale=scale, query_chunk=query_chunk),
                                    inputs, ctx, grad_out, cp_jobs.shard(ctx), grads,
                                    PARAMS)  # fmt: skip


def cp_rank(env, inputs: dict, doc_ids: torch.Tensor, grad_out: torch.Tensor, scale=None,
            query_chunk=None) -> dict:  # fmt: skip
    """:func:`run` on this rank's interval."""
    return run(inputs, cp_jobs.cp_context(env, doc_ids), grad_out, scale, query_chunk)


def cp_compile_rank(env, inputs: dict, doc_ids_list: list, grad_out: torch.Tensor):
    """:func:`cp_jobs.compile_packings` over ``doc_ids_list``: ``(frames, host syncs, worst,
    graphs)``."""
    grads = tuple(n for n in GRADS if n in inputs)
    return cp_jobs.compile_packings(call, inputs, doc_ids_list, grad_out,
                                    functools.partial(cp_jobs.cp_context, env), grads,
                                    PARAMS)  # fmt: skip
