"""Rank functions of the transformers-integration tests (fcp's packed, CP model on each rank) and of
the PLE dilated-conv tests of NeMo's Qwen3.8-Flash-Next (`tests/test_ple_conv.py`)."""

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


# ---------------------------------------------------------------------------------------------
# Qwen3.8-Flash-Next's PLE dilated conv (tests/test_ple_conv.py): fcp.short_conv with dilation
# ---------------------------------------------------------------------------------------------
def dilated_conv_fwd_bwd(env, x_full, weight, doc_ids, dilation, grad_full):
    """This rank's ``silu(short_conv(x, weight, dilation=...))`` shard, its input gradient and
    its partial weight gradient for ``sum(out * grad)`` (``env=None``: one process)."""
    from fcp.context import PackedContext
    from fcp.ops.conv import short_conv

    if env is None:
        ctx = PackedContext(doc_ids)
    else:
        ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    x = ctx.shard(x_full).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    y = short_conv(x, w, None, ctx, activation="silu", dilation=dilation)
    (y * ctx.shard(grad_full)).sum().backward()
    return y.detach(), x.grad, w.grad
