"""Rank functions of the transformers-integration tests: fcp's packed, CP model on each rank."""

from __future__ import annotations

import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests.support.hf_reference import build


def packed_model(family: str, config: dict, state_dict: dict):
    model = build(family, config)
    model.load_state_dict(state_dict)
    return enable_packed_cp(model)


def packed_forward_backward(env, family, config, state_dict, batch, cotangent):
    """This rank's outputs and parameter gradients for ``sum(output * cotangent)`` (``env=None``:
    one process). ``cotangent`` ``[batch, seq, hidden]`` is global; gradients are this rank's
    partial sums."""
    model = packed_model(family, config, state_dict)
    group = None if env is None else env.group
    local, ctx = fcp.shard_batch(group, batch)
    out = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False).last_hidden_state
    cot = ctx.shard(cotangent)
    (out * cot).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, ctx.interval
