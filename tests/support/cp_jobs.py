"""Plumbing shared by the operators' rank functions and their tests.

A rank function (run by :class:`tests.support.rank_pool.RankPool`) receives the *global* tensors,
runs one operator on its rank's contiguous interval and returns plain tensors; the test
concatenates the ranks' results in rank order and compares them with one process::

    def cp_rank(env, inputs, doc_ids, grad_out):        # in a tests/_*_rank_fns.py module
        ctx = cp_context(env, doc_ids)
        return forward_backward(call, inputs, ctx, grad_out, shard(ctx))

    res = rank_pool.run(fns.cp_rank, 4, inputs, doc_ids, grad_out)      # in the test
    out, dq = cat_ranks(res, "out"), cat_ranks(res, "q")

``call(t, ctx)`` runs the operator on a dict ``t`` of this rank's tensors. Results are dicts:
``"out"`` and one gradient per differentiated input name.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext

#: aten ops that synchronise with the host; none may appear in a compiled operator's graphs
HOST_SYNC_OPS = ("_local_scalar_dense", "aten.nonzero", "aten.item")


def cp_context(env, doc_ids: torch.Tensor) -> PackedContext:
    """This rank's context on the job's group."""
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def shard(ctx: PackedContext) -> slice:
    """The sequence slice ``ctx`` owns (everything for a single-process context)."""
    return slice(*ctx.interval)


def leaves(inputs: dict, sl: slice, grads=(), params=()) -> dict:
    """Fresh copies of ``inputs`` for one run: per-token tensors cut to ``sl`` (the ``params``,
    which are not per token, whole); those named in ``grads`` require grad."""
    return {n: (x if n in params else x[:, sl]).clone().requires_grad_(n in grads)
            for n, x in inputs.items()}  # fmt: skip


def forward_backward(call, inputs, ctx, grad_out, sl=slice(None), grads=(), params=()) -> dict:
    """``{"out": .., name: gradient for name in grads}`` of ``call`` for ``sum(out * grad_out)``
    (``grad_out`` global; no backward when ``grads`` is empty)."""
    t = leaves(inputs, sl, grads, params)
    out = call(t, ctx)
    if not grads:
        return {"out": out}
    (out.float() * grad_out[:, sl]).sum().backward()
    return {"out": out.detach(), **{n: t[n].grad for n in grads}}


def cat_ranks(results: list, key) -> torch.Tensor:
    """The ranks' ``result[key]`` concatenated along the sequence (dim 1)."""
    return torch.cat([r[key] for r in results], 1)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
class GraphRecorder:
    """A ``torch.compile`` backend: ``aot_eager`` rebuilt from its parts (AOTAutograd, boxed eager
    run of the aten graphs) that counts compiled frames and keeps every forward and backward aten
    graph. ``frames == 1`` after many calls means nothing recompiled (a graph break would raise
    under ``fullgraph=True``)."""

    def __init__(self):
        self.frames = 0
        self.graphs: list[torch.fx.Graph] = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def record(g, _):
            self.graphs.append(g.graph)
            return make_boxed_func(g.forward)

        self.frames += 1
        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    @property
    def ops(self) -> set[str]:
        """Every op called in the recorded graphs (``"aten.bmm.default"``, ...)."""
        return {str(n.target) for g in self.graphs for n in g.nodes if n.op == "call_function"}

    def host_syncs(self) -> list[str]:
        """The recorded ops that synchronise with the host (:data:`HOST_SYNC_OPS`)."""
        return sorted(o for o in self.ops if any(s in o for s in HOST_SYNC_OPS))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.int64:  # ids must be equal
        return 0.0 if torch.equal(a, b) else float("inf")
    return (a.float() - b.float()).abs().max().item()


def compile_packings(call, inputs, doc_ids_list, grad_out, ctx_fn, grads=(), params=()):
    """Compile ``call`` once (``fullgraph=True``, :class:`GraphRecorder`) and run it, and the
    eager ``call``, over many packings (``ctx_fn(doc_ids)`` makes each context).

    Returns ``(frames, host-sync ops found, max |compiled - eager|, graphs recorded)`` over the
    outputs and the ``grads`` (integer outputs must be equal: else the difference is inf).
    """
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(call, backend=recorder, fullgraph=True)
    worst = 0.0
    for doc_ids in doc_ids_list:
        ctx = ctx_fn(doc_ids)
        eager, comp = (forward_backward(fn, inputs, ctx, grad_out, shard(ctx), grads, params)
                       for fn in (call, compiled))  # fmt: skip
        worst = max([worst] + [_max_diff(eager[k], comp[k]) for k in eager])
    return recorder.frames, recorder.host_syncs(), worst, len(recorder.graphs)
