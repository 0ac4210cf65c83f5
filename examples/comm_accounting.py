"""Bytes on the wire and compilations: the accounting the demo, the benchmarks and the tests share.

* :func:`sent_bytes` / :func:`received_bytes` - what one rank sends / receives in one functional
  collective, from the buffer sizes (ring formulas for reductions);
* :class:`CommBytes` - a ``TorchDispatchMode`` that counts both for collectives run **eagerly**;
* :class:`CountingBackend` - a ``torch.compile`` backend that counts graphs (recompilations) and,
  with ``aot_eager``, reads the collectives of the forward and backward graphs;
* :func:`dynamo_counts` - Dynamo's own process-wide counters.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CommBytes",
    "CountingBackend",
    "collective_op",
    "dynamo_counts",
    "received_bytes",
    "sent_bytes",
]

# ---------------------------------------------------------------------------------------------
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
# (wait_tensor, _wrap_tensor_autograd and friends move no data)
_COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def sent_bytes(op: str, nbytes: int, args, rank: int, world: int) -> int:
    """Bytes one rank sends for a functional collective ``op`` on an input of ``nbytes``.

    With ``n`` ranks: all-gather ``(n - 1) * input`` (its shard to every other rank);
    reduce-scatter ``(n - 1) / n * input``; all-reduce ``2 (n - 1) / n * input`` (ring);
    all-to-all the input rows addressed to other ranks (``args[2]``: input split sizes).
    """
    n = world
    if op.startswith("all_gather"):
        return nbytes * (n - 1)
    if op.startswith("reduce_scatter"):
        return nbytes * (n - 1) // n
    if op.startswith("all_reduce"):
        return 2 * nbytes * (n - 1) // n
    if op.startswith("all_to_all"):
        return _others_rows(nbytes, args[2] if len(args) > 2 else None, rank, n)
    return 0


def received_bytes(op: str, in_bytes: int, out_bytes: int, args, rank: int, world: int) -> int:
    """Bytes one rank receives in a functional collective with input/output buffers of
    ``in_bytes`` / ``out_bytes``: all-gather the other ranks' shards (``out - in``); all-to-all
    the output rows from other ranks (``args[1]``: output split sizes); reductions mirror
    :func:`sent_bytes`.
    """
    if op.startswith("all_gather"):
        return out_bytes - in_bytes
    if op.startswith("all_to_all"):
        return _others_rows(out_bytes, args[1] if len(args) > 1 else None, rank, world)
    return sent_bytes(op, in_bytes, args, rank, world)


def _others_rows(nbytes: int, splits, rank: int, world: int) -> int:
    """Bytes of an all-to-all buffer of ``nbytes`` in the rows that ``splits`` (rows per rank;
    empty or ``None``: even) assigns to ranks other than ``rank``."""
    if not splits:
        return nbytes * (world - 1) // world
    splits = [int(s) for s in splits]
    return nbytes // max(sum(splits), 1) * (sum(splits) - splits[rank])


def _group_of(args, rank: int, world: int) -> tuple[int, int]:
    """``(rank, size)`` in the group a functional collective runs on (its ``group_name``
    argument); ``(rank, world)`` when it names none. CP collectives run on a sub-group of the
    data x context mesh, so the caller's world is not theirs."""
    # the last string argument: reductions name their op ("sum") with a string too
    name = next((a for a in reversed(args) if isinstance(a, str)), None)
    if not name:
        return rank, world
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(name)
    return dist.get_rank(pg), dist.get_world_size(pg)


def _nbytes(x) -> int:
    """Bytes of a tensor, or of a list of tensors (coalesced collectives); fx nodes via meta."""
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    if isinstance(x, torch.fx.Node):
        x = x.meta["val"]
    return x.numel() * x.element_size()


def collective_op(target) -> str | None:
    """The op name of a data-moving functional collective, else ``None``."""
    name = getattr(target, "name", None)
    if not callable(name):
        return None
    ns, _, op = name().partition("::")
    if ns in _COLLECTIVE_NAMESPACES and op.startswith(_COLLECTIVE_OPS):
        return op
    return None


class CommBytes(TorchDispatchMode):
    """Counts the bytes this rank sends (:func:`sent_bytes`) and receives
    (:func:`received_bytes`) in functional collectives run **eagerly**, and the calls. Dynamo
    refuses to trace under a user dispatch mode, so compiled code is counted by
    :class:`CountingBackend` instead."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world
        self.sent = 0
        self.received = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = collective_op(func)
        if op is not None:
            self.calls += 1
            n_in, n_out = _nbytes(args[0]), _nbytes(out)
            rank, world = _group_of(args, self.rank, self.world)
            self.sent += sent_bytes(op, n_in, args, rank, world)
            self.received += received_bytes(op, n_in, n_out, args, rank, world)
        return out


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs Dynamo hands it (``graphs - 1`` is the
    number of recompilations of a ``fullgraph=True`` function), then defers to ``backend``.

    With ``"aot_eager"`` it also reads every collective of the forward and backward graphs
    AOTAutograd produces (static shapes, so the bytes of a graph are fixed) and adds them to
    ``sent`` / ``calls`` each time a graph runs: the live count of bytes on the wire.
    """

    def __init__(self, backend: str = "aot_eager", rank: int = 0, world: int = 1):
        self.name, self.rank, self.world = backend, rank, world
        self.graphs = 0
        self.sent = 0
        self.calls = 0
        self.counts_bytes = backend == "aot_eager"

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if not self.counts_bytes:
            return torch._dynamo.lookup_backend(self.name)(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs, fw_compiler=self._compile, bw_compiler=self._compile)

    def _compile(self, fx_g, example_inputs):
        from torch._dynamo.backends.debugging import boxed_nop

        sent = calls = 0
        for node in fx_g.graph.nodes:
            op = collective_op(node.target) if node.op == "call_function" else None
            if op is not None:
                rank, world = _group_of(node.args, self.rank, self.world)
                sent += sent_bytes(op, _nbytes(node.args[0]), node.args, rank, world)
                calls += 1
        inner = boxed_nop(fx_g, example_inputs)

        def run(args):
            self.sent += sent
            self.calls += calls
            return inner(args)

        run._boxed_call = True
        return run


def dynamo_counts() -> dict:
    """Dynamo's own counters (process-wide): graphs captured, graph breaks, AOT compilations."""
    c = torch._dynamo.utils.counters
    return {
        "unique_graphs": c["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(c["graph_break"].values()),
        "aot_compiles": c["aot_autograd"].get("total", 0),
    }


