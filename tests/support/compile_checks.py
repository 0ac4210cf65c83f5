"""What the operators' compile tests share: an aot_autograd backend that records the ops of every
forward and backward graph, the host-synchronising ops no graph may hold, and random packings of
one fixed shape (so a recompilation can only come from the packing's values)."""

from __future__ import annotations

import torch

__all__ = ["HOST_SYNC_OPS", "random_packings", "recording_backend"]

#: aten ops that synchronise with the host (``.item()``, ``nonzero``): never in an fcp graph
HOST_SYNC_OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default",
                           "aten.item.default"})  # fmt: skip


def recording_backend():
    """``(backend, seen)``: a ``torch.compile`` backend (aot_autograd, eager kernels) and what it
    saw: ``seen["frames"]`` Dynamo frames compiled, ``seen["ops"]`` the call targets of every
    forward and backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = {"frames": 0, "ops": set()}

    def record(gm, example_inputs):
        seen["ops"].update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    inner = aot_autograd(fw_compiler=record, bw_compiler=record)

    def backend(gm, example_inputs):
        seen["frames"] += 1
        return inner(gm, example_inputs)

    return backend, seen


def random_packings(count: int, batch: int, seq: int, seed: int, max_doc: int = 15,
                    max_pad: int = 11) -> list[torch.Tensor]:  # fmt: skip
    """``count`` int64 doc-id maps ``[batch, seq]``: per row a pad tail of 0..``max_pad``
    tokens after documents of 1..``max_doc`` tokens (the last one cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    maps = []
    for _ in range(count):
        rows = []
        for _ in range(batch):
            pad = int(torch.randint(0, max_pad + 1, (), generator=gen))
            ids, doc = [], 0
            while len(ids) < seq - pad:
                doc += 1
                ids += [doc] * int(torch.randint(1, max_doc + 1, (), generator=gen))
            rows.append(ids[: seq - pad] + [0] * pad)
        maps.append(torch.tensor(rows))
    return maps
