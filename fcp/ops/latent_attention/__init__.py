"""Latent attention: multi-head latent attention (MLA) over selected tokens, exact under CP.

GLM-5.3-Flash's DSA layers compress each token's keys and values into one latent ``c``
(``kv_lora_rank`` numbers, shared by all heads) and expand it per head with ``kv_b_proj``; each
query then attends to the tokens an indexer selected. Under CP the latent is the smallest thing
that determines K and V, so it is what crosses ranks.

* :mod:`.reference` - the definition (float64, one query at a time; tests only);
* :mod:`.gather` - the ``"gather"`` backend: one all-gather of the latent, the expansion of the
  prefix this rank's queries can read, then the selected keys gathered per query.

:func:`latent_attention` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.attention import check_selection
from fcp.ops.kit.common import (
    autocast_off,
    choose_backend,
    default_scale,
    finite_or_zero,
    zero_nonfinite_grad,
)
from fcp.ops.latent_attention.gather import latent_attention_gather

__all__ = ["BACKENDS", "latent_attention"]

#: ``"gather"``: all-gathers the latent, expands it, gathers each query's selected keys (exact,
#: every device).
BACKENDS = ("gather",)
_RUN = {"gather": latent_attention_gather}


def latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_weight: torch.Tensor,
                     indices: torch.Tensor, ctx: PackedContext, *,
                     kv_bias: torch.Tensor | None = None, k_rope: torch.Tensor | None = None,
                     scale: float | None = None, query_chunk: int | None = None,
                     backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """Softmax attention of each query over its selected tokens, keys and values expanded per
    head from a shared latent.

    Args:
        q: ``[batch, local_seq, heads, Dk]``, this rank's queries (with ``k_rope``: their last
            ``R`` channels are the rotary part, already rotated).
        latent: ``[batch, local_seq, rank]``, this rank's KV latent (after its norm).
        kv_weight: ``[heads * (Dk - R + Dv), rank]``, ``nn.Linear``'s layout
            (``kv_b_proj.weight``): for each head, ``Dk - R`` key rows then ``Dv`` value rows
            (``R = 0`` without ``k_rope``); ``Dv`` follows from the shape.
        indices: int ``[batch, local_seq, W]``: **global** token ids, ``-1`` for none; a set
            (order and repeats do not matter). Ids outside ``[start of doc(t), t]`` are ignored.
            From :func:`~fcp.ops.kpool_indexer.kpool_indexer` or any indexer; no gradient.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        kv_bias: ``[heads * (Dk - R + Dv)]`` or ``None`` (``kv_b_proj.bias``).
        k_rope: ``[batch, local_seq, R]`` or ``None``: MLA's rotary key (GLM-5, DeepSeek),
            rotated, shared by every head: the last ``R`` channels of each head's key.
        scale: softmax scale, default ``Dk ** -0.5``.
        query_chunk: queries whose keys are gathered at a time (bounds memory); default about
            4M elements per chunk. Results do not depend on it, bitwise.
        backend: ``"auto"`` (= ``"gather"``) or ``"gather"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype. The expansion runs in the common
        dtype of ``latent`` and ``kv_weight``; scores, softmax and accumulation in fp32 (fp64
        for fp64 inputs). A query with no valid selected token (a pad query, an all ``-1`` row)
        gets exact zeros and sends no gradient.

    Under CP: one all-gather of the latent (with ``k_rope`` beside it) in its own dtype (``rank
    + R`` numbers per token, never the expanded ``heads * (Dk + Dv)``); its backward reduce-scatter sums the ranks' gradients
    in fp32 and rounds once. Each rank expands only the tokens up to its last query. Gradients
    of ``kv_weight`` and ``kv_bias`` are per-rank partial sums (the data-parallel reduction over
    the CP ranks sums them). Memory: the expanded keys and values (``[batch, seq_end, heads,
    Dk + Dv]``) are not kept for the backward, which expands the latent again (one matmul). No
    host synchronisation, static shapes: a compiled model does not recompile for a new packing
    or selection; the expansion, the selection and the softmax are one custom op each way
    (opaque to the compiler, so a dynamic compile does not trace them). Documents are isolated as in
    :func:`~fcp.ops.index_attention.index_attention` (a NaN in one document's inputs leaves
    every other document's outputs and gradients unchanged).

    Example: one head, ``Dk = Dv = 1``, rank 1, ``kv_weight = [[1], [1]]`` (key = value =
    latent); token 1 reads tokens 0 and 1 with probabilities ``softmax([1, 2])``::

        >>> ctx = PackedContext(torch.tensor([[1, 1]]))
        >>> latent = torch.tensor([[[1.0], [2.0]]])
        >>> ids = torch.tensor([[[0, -1], [0, 1]]])
        >>> out = latent_attention(torch.ones(1, 2, 1, 1), latent, torch.ones(2, 1), ids, ctx)
        >>> out.flatten()
        tensor([1.0000, 1.7311])
    """
    name = "latent_attention"
    check_context(ctx, fn=name, name="ctx")
    batch, local = ctx.batch_size, ctx.local_seq_len
    check_tensor(q, "q", fn=name, kind="float", shape=(batch, local, None, None),
                 layout="[batch, local_seq, heads, Dk]")  # fmt: skip
    check_tensor(latent, "latent", fn=name, kind="float", shape=(batch, local, None),
                 layout="[batch, local_seq, rank]")  # fmt: skip
    heads, dk, rank = q.shape[2], q.shape[3], latent.shape[2]
    check_tensor(kv_weight, "kv_weight", fn=name, kind="float", shape=(None, rank),
                 layout="[heads * (Dk - R + Dv), rank]")  # fmt: skip
    rope = 0
    if k_rope is not None:
        check_tensor(k_rope, "k_rope", fn=name, kind="float", shape=(batch, local, None),
                     layout="[batch, local_seq, R]")  # fmt: skip
        rope = k_rope.shape[2]
        if not 0 < rope < dk:
            raise ValueError(f"{name}: k_rope {tuple(k_rope.shape)} must have 0 < R < Dk={dk} "
                             f"(q {tuple(q.shape)})")  # fmt: skip
    rows = kv_weight.shape[0]
    if heads < 1 or dk < 1 or rows % heads or rows // heads <= dk - rope:
        raise ValueError(
            f"{name}: kv_weight {tuple(kv_weight.shape)} must have heads * (Dk - R + Dv) rows "
            f"with heads={heads}, Dk={dk} from q {tuple(q.shape)}, R={rope} and Dv >= 1"
        )
    if kv_bias is not None:
        check_tensor(kv_bias, "kv_bias", fn=name, kind="float", shape=(rows,))
    query_chunk = check_selection(indices, query_chunk, batch, local, fn=name)
    backend = choose_backend(name, backend, BACKENDS, "gather")
    scale = default_scale(dk, scale)
    with autocast_off(q.device):
        rope_key = None if k_rope is None else finite_or_zero(k_rope)
        out = _RUN[backend](finite_or_zero(q), finite_or_zero(latent), kv_weight, kv_bias,
                            indices.detach(), ctx, scale, query_chunk, rope_key)  # fmt: skip
    return zero_nonfinite_grad(out)
