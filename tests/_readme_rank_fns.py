"""The README's data x context training block and the docs' multi-rank blocks, run on gloo ranks
(``tests/test_readme.py``, ``tests/test_docs.py``)."""

from __future__ import annotations

import torch


def training_block(env, code: str, global_batch: dict):
    """Execute the README block on this rank with the names its prose promises (a transformers
    ``Qwen3_5ForCausalLM`` as ``model``, ``dp``, ``cp``, ``global_batch``); return the global
    loss, the global token count and the parameters the step left unchanged."""
    from tests._causal_lm_rank_fns import causal_lm

    model = causal_lm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = dict(model=model, dp=2, cp=2, global_batch=global_batch)
    exec(compile(code, "README.md", "exec"), names)
    loss = names["loss"]
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    frozen = sorted(n for n in before if torch.equal(full[n], before[n]))
    return float(loss.value), float(loss.tokens), frozen


def doc_block(env, code: str, where: str) -> None:
    """Execute a ``<!-- ranks: N -->`` block of ``docs/`` on this rank, in a fresh namespace, as
    the script it is (``tests/test_docs.py``)."""
    exec(compile(code, where, "exec"), {"__name__": "__main__"})
