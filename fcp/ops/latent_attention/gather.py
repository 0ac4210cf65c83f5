"""Latent attention by gathering the selected keys: the ``"gather"`` backend of
:func:`fcp.ops.latent_attention.latent_attention`, every device.

Three steps:

* the latent crosses ranks, not K/V: one :func:`~fcp.comm.all_gather_sequence` of ``[batch,
  local_seq, rank (+ R)]`` (the rotary key beside it) in the latent's dtype (bf16 on the wire for a bf16 model), whose backward
  reduce-scatter sums the ranks' partial gradients in fp32 before rounding once;
* the expansion ``kv_weight`` of the gathered prefix ``[0, seq_end)`` only: a query never reads a
  token after it, so later ranks' tokens are never expanded here (rank ``r`` of ``w`` expands
  ``(r + 1) / w`` of the sequence);
* the selected keys and values per query: :func:`selected_slots` and the kernel of
  :func:`~fcp.ops.index_attention.index_attention` (``O(W)`` per query, no ``local x
  sequence`` score).

The last two run inside the custom ops ``fcp::latent_attention_fwd`` / ``_bwd`` (one opaque
node each for the compiler, fake kernels, ``register_autograd``): traced, the expansion, the
slot sort and the masks were a few hundred symbolic-shape ops, and a dynamic compile of a DSA
layer cost several times a static one. The forward saves its inputs, the output and the
log-sum-exp, not the expanded keys and values (``[batch, seq_end, heads, Dk + Dv]``, the
largest tensor of the layer); the backward expands again (one matmul) and pulls the gradients
of the expansion back with autograd (:func:`~fcp.ops.kit.opaque.autograd_in_kernel`), so they
are autograd's own formulas, as in an eager run.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.common import (
    compute_dtype,
    finite_or_zero,
    register_fp32_autocast,
    scalar_tensor,
)
from fcp.ops.kit.gather import (
    chunk_rows,
    index_attention_bwd,
    index_attention_fwd,
    selected_slots,
)
from fcp.ops.kit.opaque import autograd_in_kernel

__all__ = ["latent_attention_bwd", "latent_attention_fwd", "latent_attention_gather"]


def _expand(full: torch.Tensor, kv_weight: torch.Tensor, kv_bias: torch.Tensor | None = None,
            *, seq_end: int, heads: int, dk: int, rope: int) -> torch.Tensor:  # fmt: skip
    """Head-major keys and values ``[batch, heads, seq_end, Dk + Dv]`` (per head keys then
    values, the layout of ``fcp::index_attention_fwd``) of the gathered latent ``full [batch,
    seq, rank + rope]`` up to ``seq_end``, in the common dtype of the latent and the weight."""
    rank = full.shape[-1] - rope
    dt = torch.promote_types(full.dtype, kv_weight.dtype)
    bias = None if kv_bias is None else kv_bias.to(dt)
    prefix = full[:, :seq_end].to(dt)
    kv = F.linear(prefix[..., :rank], kv_weight.to(dt), bias).unflatten(-1, (heads, -1))
    if rope:  # each head's key: its own Dk - R channels, then the shared R
        nope = dk - rope
        shared = prefix[:, :, None, rank:].expand(-1, -1, heads, -1)
        kv = torch.cat([kv[..., :nope], shared, kv[..., nope:]], -1)
    # a non-finite weight must not carry one document's NaN into another's scores
    return finite_or_zero(kv).transpose(1, 2).contiguous()


def _chunk(chunk: int, indices: torch.Tensor, heads: int, dk: int, dv: int) -> int:
    """``chunk``, or (0) the default :func:`~fcp.ops.kit.gather.chunk_rows`, on concrete
    sizes: a dynamic length does not specialise the graph on the chunking."""
    return chunk or chunk_rows(indices.shape[-1], heads, heads, dk, dv, indices.shape[1])


@torch.library.custom_op("fcp::latent_attention_fwd", mutates_args=())
def latent_attention_fwd(q: torch.Tensor, full: torch.Tensor, kv_weight: torch.Tensor,
                         kv_bias: Optional[torch.Tensor], indices: torch.Tensor,
                         doc_ids: torch.Tensor, seq_start: int, seq_end: int,
                         scale: torch.Tensor, rope: int,
                         chunk: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [b, L, H, Dv], lse [b, L, H])`` in the compute dtype (fp32, fp64 for fp64 inputs).

    ``q [b, L, H, Dk]`` (finite), ``full [b, S, rank + rope]`` the gathered latent (finite),
    ``kv_weight [H * (Dk - rope + Dv), rank]``, ``kv_bias`` or ``None``, ``indices [b, L, W]``
    global ids, ``doc_ids [b, S]``; ``scale`` a 0-d fp64 tensor; ``chunk`` queries at a time (0:
    the default)."""
    heads, dk = q.shape[2], q.shape[3]
    kvh = _expand(full, kv_weight, kv_bias, seq_end=seq_end, heads=heads, dk=dk, rope=rope)
    slots, valid = selected_slots(indices, doc_ids, seq_start)
    return index_attention_fwd(q, kvh, slots, valid, scale, dk,
                               _chunk(chunk, indices, heads, dk, kvh.shape[-1] - dk))  # fmt: skip


@latent_attention_fwd.register_fake
def _(q, full, kv_weight, kv_bias, indices, doc_ids, seq_start, seq_end, scale, rope, chunk):
    heads, dk = q.shape[2], q.shape[3]
    dv = kv_weight.shape[0] // heads - (dk - rope)
    dt = compute_dtype(q, full, kv_weight)
    return q.new_empty(*q.shape[:3], dv, dtype=dt), q.new_empty(q.shape[:3], dtype=dt)


@torch.library.custom_op("fcp::latent_attention_bwd", mutates_args=())
def latent_attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, full: torch.Tensor,
                         kv_weight: torch.Tensor, kv_bias: Optional[torch.Tensor],
                         indices: torch.Tensor, doc_ids: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, seq_start: int, seq_end: int, scale: torch.Tensor,
                         rope: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, d full, d kv_weight, d kv_bias)`` in the inputs' dtypes (``d kv_bias`` empty
    without a bias); ``out`` and ``lse`` from the forward."""
    heads, dk = q.shape[2], q.shape[3]
    slots, valid = selected_slots(indices, doc_ids, seq_start)
    with autograd_in_kernel():  # one expansion, recorded: its gradients are autograd's
        leaves = [x.detach().requires_grad_() for x in (full, kv_weight, kv_bias)
                  if x is not None]  # fmt: skip
        kvh = _expand(*leaves, seq_end=seq_end, heads=heads, dk=dk, rope=rope)
    dq, dkvh = index_attention_bwd(grad_out, q, kvh.detach(), slots, valid, out, lse, scale, dk,
                                   _chunk(chunk, indices, heads, dk, kvh.shape[-1] - dk))
    with autograd_in_kernel():
        grads = torch.autograd.grad(kvh, leaves, dkvh)
    d_bias = grads[2].contiguous() if kv_bias is not None else q.new_empty(0)
    return dq, grads[0].contiguous(), grads[1].contiguous(), d_bias


@latent_attention_bwd.register_fake
def _(grad_out, q, full, kv_weight, kv_bias, indices, doc_ids, out, lse, seq_start, seq_end,
      scale, rope, chunk):  # fmt: skip
    d_bias = q.new_empty(0) if kv_bias is None else torch.empty_like(kv_bias)
    return torch.empty_like(q), torch.empty_like(full), torch.empty_like(kv_weight), d_bias


def _setup(ctx, inputs, output):
    q, full, kv_weight, kv_bias, indices, doc_ids, seq_start, seq_end, scale, rope, chunk = inputs
    ctx.save_for_backward(q, full, kv_weight, kv_bias, indices, doc_ids, *output, scale)
    ctx.args = (seq_start, seq_end, rope, chunk)


def _backward(ctx, grad_out, grad_lse):
    q, full, kv_weight, kv_bias, indices, doc_ids, out, lse, scale = ctx.saved_tensors
    seq_start, seq_end, rope, chunk = ctx.args
    dq, dfull, dw, db = latent_attention_bwd(grad_out, q, full, kv_weight, kv_bias, indices,
                                             doc_ids, out, lse, seq_start, seq_end, scale, rope,
                                             chunk)  # fmt: skip
    return dq, dfull, dw, None if kv_bias is None else db, None, None, None, None, None, None, None


latent_attention_fwd.register_autograd(_backward, setup_context=_setup)
register_fp32_autocast(latent_attention_fwd, latent_attention_bwd)


def latent_attention_gather(q: torch.Tensor, latent: torch.Tensor, kv_weight: torch.Tensor,
                            kv_bias: torch.Tensor | None, indices: torch.Tensor,
                            ctx: PackedContext, scale: float, query_chunk: int | None,
                            k_rope: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (arguments checked by the
    dispatcher, non-finite ``q`` / ``latent`` / ``k_rope`` entries already zeroed)."""
    # the rotary key travels with the latent: one all-gather
    both = latent if k_rope is None else torch.cat([latent, k_rope.to(latent.dtype)], -1)
    full = all_gather_sequence(both, ctx, dtype=torch.float32).to(latent.dtype)
    rope = 0 if k_rope is None else k_rope.shape[-1]
    out, _ = latent_attention_fwd(q, full, kv_weight, kv_bias, indices, ctx.doc_ids,
                                  ctx.seq_start, ctx.seq_end, scalar_tensor(scale, q.device),
                                  rope, query_chunk or 0)  # fmt: skip
    # the gather's backward reduce-scatter runs on every rank, whatever the loss reads
    return with_anchors(out.to(q.dtype), ctx, full)
