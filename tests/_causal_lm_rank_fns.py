"""Rank functions of ``tests/test_causal_lm.py``: an enabled tiny Qwen3.5 causal LM given the
``shift_labels`` of :func:`fcp.shard_batch` on each CP rank."""

from __future__ import annotations

import torch

import fcp
from fcp.integrations.hf import enable_packed_cp


def causal_lm(seed: int = 0):
    """A tiny fp32 ``Qwen3_5ForCausalLM`` (``tests/support/hf_reference.py``'s configuration)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.support.hf_reference import QWEN3_5_TINY

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**QWEN3_5_TINY)
    config._attn_implementation = "eager"
    return Qwen3_5ForCausalLM(config)


def loss_and_grads(env, batch: dict, items=None) -> tuple[float, dict]:
    """``(.loss, {parameter: gradient})`` of the enabled model on this rank's shard of ``batch``
    (every rank holds the whole batch), with ``num_items_in_batch=items`` when given; ``env``
    ``None``: one process."""
    model = enable_packed_cp(causal_lm())
    local, ctx = fcp.shard_batch(None if env is None else env.group, batch)
    extra = {} if items is None else {"num_items_in_batch": items}
    loss = model(**local, cp_context=ctx, **extra).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}  # fmt: skip
