"""Functions run on pool ranks by the token-history tests (importable by module path)."""

from __future__ import annotations

import functools

import torch

from fcp.ops.token_history import token_history
from tests.support import cp_jobs


def _call(size: int, fill: int, reset: int | None):
    def call(t, ctx):
        return token_history(t["tokens"], ctx, size, fill=fill, reset=reset)

    return call


def cp_rank(env, tokens: torch.Tensor, doc_ids: torch.Tensor, size: int, fill: int,
            reset: int | None) -> torch.Tensor:  # fmt: skip
    """This rank's ``[batch, local_seq, size]`` history of the global ``tokens``."""
    ctx = cp_jobs.cp_context(env, doc_ids)
    return token_history(tokens[:, cp_jobs.shard(ctx)], ctx, size, fill=fill, reset=reset)


def cp_compile_rank(env, tokens, doc_ids_list, size: int, fill: int, reset: int | None):
    """:func:`cp_jobs.compile_packings` over ``doc_ids_list``: ``(frames, host syncs, worst,
    graphs)``."""
    return cp_jobs.compile_packings(_call(size, fill, reset), {"tokens": tokens}, doc_ids_list,
                                    None, functools.partial(cp_jobs.cp_context, env))  # fmt: skip
