"""Functions run on pool ranks by ``tests/test_examples.py`` (importable by module path).

Each one runs the demo's own training loop (:func:`examples.demo.train`) on the job's gloo group
and returns plain data: per-step records, the run summary and the trained parameters.
"""

from __future__ import annotations

import torch

from examples.demo import DemoOptions, train


def train_on_ranks(env, opts: dict, fresh_compile: bool = False) -> dict:
    """``train(env.group, DemoOptions(**opts))``; ``fresh_compile`` resets Dynamo first so the
    compile counters start from zero in this (persistent) worker."""
    if fresh_compile:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    out = train(env.group, DemoOptions(**opts))
    params = {}
    for k, v in out["model"].named_parameters():  # FSDP2 shards: gather each in full
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        params[k] = v.detach().clone()
    return {"records": out["records"], "summary": out["summary"], "params": params}
