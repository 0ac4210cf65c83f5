"""Oracles and comparisons of the KDA / Gated DeltaNet tests (both gate kinds of ``fcp.kda``).

Functions under comparison take the five operator inputs positionally, ``fn(q, k, v, g, beta)``,
and return the output; :func:`check` compares the output and all five input gradients (the
operator-independent pieces: :mod:`tests.support.operator_checks`)::

    ctx = PackedContext(doc_ids)
    check(lambda *xs: kda(*xs, ctx),                                  # the operator
          lambda *xs: per_document(loop_doc, xs, doc_ids, 8**-0.5),   # the fp64 loop per document
          kda_inputs(2, 52, 1, 2, 8, 6, seed=0), grad_out, tol=1e-5)

Error metric: :func:`tests.support.inputs.rel_err` (``max |x - ref| / max |ref|``) per tensor.
"""

from __future__ import annotations

import torch

from tests.support import operator_checks
from tests.support.inputs import KDA_NAMES
from tests.support.operator_checks import per_document

__all__ = ["check", "loop_doc", "out_and_grads", "per_document"]


def loop_doc(q, k, v, g, beta, scale):
    """One document, fp64 per-token recurrence ``S <- exp(g_t) S``, then the delta rule.

    q, k ``[T, H, K]``; v ``[T, HV, V]``; g ``[T, HV, K]`` (KDA: a decay per key channel) or
    ``[T, HV]`` (GDN: one per head); beta ``[T, HV]``. Value head ``j`` reads key head
    ``j // (HV / H)``."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    state = q.new_zeros(v.shape[1], q.shape[2], v.shape[2])
    outs = []
    for t in range(q.shape[0]):
        decay = g[t].exp()
        state = state * (decay[..., None] if decay.dim() == 2 else decay[:, None, None])
        resid = v[t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + beta[t][:, None, None] * k[t][..., None] * resid[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs)


def out_and_grads(fn, inputs: dict, grad_out: torch.Tensor):
    """``(out, {name: gradient})`` of ``fn(q, k, v, g, beta)`` for ``sum(out * grad_out)``."""
    return operator_checks.out_and_grads(fn, inputs, grad_out, KDA_NAMES)


def check(fn_a, fn_b, inputs, grad_out, tol) -> dict:
    """Output and every input gradient of ``fn_a`` finite and within ``tol`` (rel) of
    ``fn_b``'s; returns the errors."""
    return operator_checks.check(fn_a, fn_b, inputs, grad_out, tol, KDA_NAMES)
