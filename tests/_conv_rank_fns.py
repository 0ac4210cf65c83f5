"""Functions run on pool ranks by the short-conv tests (importable by module path)."""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.conv import short_conv


def conv_fwd_bwd(env, x_full, weight, bias, doc_ids, activation, out_weights):
    """Run ``short_conv`` on this rank's slice; return output and grads (param grads partial)."""
    ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    s, e = ctx.interval
    x = x_full[:, s:e].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    y = short_conv(x, w, b, ctx, activation=activation)
    (y.float() * out_weights[:, s:e]).sum().backward()
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def conv_compiled(env, x_full, weight, doc_ids_list):
    """Compiled (fullgraph) CP conv equals eager for several packings, with one compilation."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(short_conv, backend=counter, fullgraph=True)
    outs = []
    for doc_ids in doc_ids_list:
        ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
        s, e = ctx.interval
        pair = []
        for f in (short_conv, fn):
            x = x_full[:, s:e].clone().requires_grad_()
            y = f(x, weight, None, ctx, "silu")
            y.pow(2).sum().backward()
            pair.append((y.detach(), x.grad))
        outs.append(pair)
    return outs, counter.frame_count
