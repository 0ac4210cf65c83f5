"""The README's data x context training block, run on gloo ranks (``tests/test_readme.py``)."""

from __future__ import annotations

import torch


def training_block(env, code: str, global_batch: dict):
    """Execute the README block on this rank with the names its prose promises (a model with
    ``blocks``, ``dp``, ``cp``, ``global_batch``, the torch imports); return the global loss,
    the global token count and the parameters the step left unchanged."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fcp
    from examples.models import build_model

    torch.manual_seed(0)
    model = build_model("glm5", layers=("kda", "sparse"), d_model=32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = dict(torch=torch, F=F, fcp=fcp, fully_shard=fully_shard, model=model, dp=2, cp=2,
                 global_batch=global_batch,
                 # CPU gloo ranks here; the README's GPU mesh is the same call with "cuda"
                 init_device_mesh=lambda device, *a, **k: init_device_mesh("cpu", *a, **k))
    exec(compile(code, "README.md", "exec"), names)
    loss = names["loss"]
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    frozen = sorted(n for n in before if torch.equal(full[n], before[n]))
    return float(loss.value), float(loss.tokens), frozen
