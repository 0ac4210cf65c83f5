"""Rank functions of ``tests/test_hf_qwen4_exp.py``: Qwen4-Exp's PLE layer on fcp, on each rank
(the whole model's rank function is :func:`tests._hf_rank_fns.packed_forward_backward`)."""

from __future__ import annotations

import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests.support.hf_reference import build


def ple_shard(env, config: dict, state_dict: dict, layer: int, batch: dict, hidden):
    """This rank's ``(n-gram embeddings [B, L, ple_embed_dim], PLE output [B, L, hc * D])`` of
    layer ``layer``'s PLE (enabled alone) on the packed ``batch`` (``input_ids``, ``seq_lens``)
    and hidden streams ``hidden [B, S, hc * D]`` (global; ``env=None``: one process)."""
    model = build("qwen4_exp", config)
    model.load_state_dict(state_dict)
    ple = enable_packed_cp(model.layers[layer].ple)
    local, ctx = fcp.shard_batch(None if env is None else env.group, batch)
    with torch.no_grad():
        ids = local["input_ids"]
        emb = ple.ple_embedding.ngram_embedding(ple.fcp_ngram_ids(ids, ctx)).flatten(-2)
        out = ple(ctx.shard(hidden), input_ids=ids, cp_context=ctx)
    return emb, out
