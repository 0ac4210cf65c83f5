"""FlexAttention backend (CUDA), fed the same K/V and the same masks as the dense backend.

Every operator reduces to one rule per key, so one mask_mod serves both::

    visible(t, key) = key_doc[key] == doc(t) != 0  and  q_lo[key] <= t <= q_hi[key]

with ``t`` the *local* query index and per-key int64 bounds:

* doc-causal key at global position ``s``: ``q_lo = s - seq_start``, ``q_hi = +inf``;
* compressed block ``b``: ``q_lo = (b+1)*ratio - seq_start`` (the block ends before ``t``);
* window key ``j`` of ``cat(halo, local)``: ``j - (window-1) <= t <= j``.

Pad queries have empty rows; FlexAttention returns zeros for them (as the dense backend does) and
no gradient. Softmax statistics are fp32 inside the kernel for bf16 inputs.

Chosen by ``backend="flex"`` (the default for CUDA tensors). FlexAttention has no CPU
backward, so on CPU only gradient-free calls work: the tests use that to check the masks against
the dense backend.

Guarantees: the dense backend's masks exactly; the kernel's own rounding (online softmax, fp32
statistics); masked keys contribute exact zeros (with finite inputs, which the operators ensure),
so documents are isolated; deterministic forward on CUDA; static shapes (the block mask is built
from the replicated map in-graph), no host synchronisation.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "flex_attend", "UNBOUNDED"]

UNBOUNDED = 2**62


def available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - very old torch
        return False
    return True


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _kernel(q: torch.Tensor):
    """``flex_attention``; outside an outer ``torch.compile`` on CUDA, a compiled (fused) one
    (eager FlexAttention materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling() or not q.is_cuda:
        return flex_attention
    return _compiled_flex_attention()


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_q: torch.Tensor,
                key_doc: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor,
                scale: float, *, sinks: torch.Tensor | None = None,
                softcap: float | None = None) -> torch.Tensor:
    """Masked attention with FlexAttention.

    Args:
        q: ``[batch, local, heads, D]``; ``k``, ``v``: ``[batch, keys, kv_heads, D]``.
        doc_q: ``[batch, local]`` query doc ids; ``key_doc``: ``[batch, keys]``.
        q_lo, q_hi: int64 ``[keys]``, the local query range that may see each key.
        sinks: ``[batch, local, heads]`` or ``None``: a zero-value logit per query and head in
            the softmax's denominator, applied from the kernel's log-sum-exp (``out *
            sigmoid(lse - sink)``, differentiable through the lse).
        softcap: scores (after ``scale``) become ``softcap * tanh(score / softcap)``.

    Returns ``[batch, local, heads, Dv]`` in ``q``'s dtype.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, ki):
        dq = doc_q[b, qi]
        return (key_doc[b, ki] == dq) & (dq != 0) & (q_lo[ki] <= qi) & (qi <= q_hi[ki])

    batch, lq, heads = q.shape[:3]
    mask = create_block_mask(mask_mod, batch, None, lq, k.shape[1], device=q.device)
    score_mod = None
    if softcap:

        def score_mod(score, b, h, qi, ki):
            return torch.tanh(score / softcap) * softcap

    out = _kernel(q)(
        q.transpose(1, 2),
        k.to(q.dtype).transpose(1, 2),
        v.to(q.dtype).transpose(1, 2),
        score_mod=score_mod,
        block_mask=mask,
        scale=scale,
        enable_gqa=heads != k.shape[2],
        return_lse=sinks is not None,
    )
    if sinks is None:
        return out.transpose(1, 2).to(q.dtype)
    out, lse = out
    # softmax over [scores, sink] = softmax(scores) * e^lse / (e^lse + e^sink); a row without
    # visible keys has out = 0 whatever its lse
    weight = torch.sigmoid(lse.float() - sinks.float().transpose(1, 2))
    return (out.float() * weight[..., None]).transpose(1, 2).to(q.dtype)
