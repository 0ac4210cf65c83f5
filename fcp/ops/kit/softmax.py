"""Dense masked softmax attention in fp32: the backend that runs everywhere (CPU included).

:func:`attend` takes the queries and one or more *key parts*, scores them all, and normalises in
**one** softmax. A part is either

* shared: ``k``, ``v`` ``[batch, keys, kv_heads, D]`` with a mask ``[batch, q, keys]``, or
* per-query: ``k``, ``v`` ``[batch, q, kv_heads, keys, D]`` (each query has its own keys, e.g. a
  sliding window or gathered blocks; this layout makes the products plain batched matmuls) with
  a mask ``[batch, q, keys]``.

GQA: query head ``h`` uses kv head ``h // (heads // kv_heads)``. Scores, softmax and the weighted
sum run in fp32 whatever the input dtype; the result is cast to ``q``'s dtype.

Masked keys get probability exactly 0 (``torch.where``, not an additive bias), so the values of
other documents never reach an output, bitwise. A query whose row is entirely masked (a pad query)
gets an output of exact zeros and sends no gradient anywhere: its softmax runs over its raw
(finite) scores and the probabilities are then replaced by zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["KeyPart", "attend"]


class KeyPart(NamedTuple):
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor  # bool [batch, q, keys]
    per_query: bool = False


def attend(q: torch.Tensor, parts: list[KeyPart], scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[batch, q, heads, D]`` over the union of ``parts``.

    Returns ``[batch, q, heads, Dv]`` in ``q``'s dtype. Scores live in ``[batch, kv_heads, groups,
    q, keys]`` so the (query, key) mask broadcasts over leading axes only.
    """
    kv_heads = parts[0].k.shape[2] if parts[0].per_query else parts[0].k.shape[-2]
    qf = q.float().unflatten(2, (kv_heads, -1)) * scale  # [b, q, hkv, g, d]

    scores = []
    for part in parts:
        if part.per_query:  # [b, q, hkv, g, keys] -> [b, hkv, g, q, keys] (keys: a few)
            s = torch.matmul(qf, part.k.float().transpose(-1, -2)).permute(0, 2, 3, 1, 4)
        else:
            s = torch.einsum("bqhgd,bkhd->bhgqk", qf, part.k.float())
        scores.append(s)
    s = torch.cat(scores, -1) if len(scores) > 1 else scores[0]
    mask = torch.cat([p.mask for p in parts], -1) if len(parts) > 1 else parts[0].mask

    # An empty row (pad query) softmaxes its raw scores (finite) and is then zeroed, so it gives
    # zeros and no gradient. Both masks are combined at [b, q, keys] size, before broadcasting.
    soft_mask = mask | ~mask.any(-1, keepdim=True)
    p = torch.softmax(torch.where(soft_mask[:, None, None], s, float("-inf")), -1)
    p = torch.where(mask[:, None, None], p, 0.0)

    out, offset = None, 0
    for part in parts:
        n = part.mask.shape[-1]
        pp = p[..., offset : offset + n]
        offset += n
        if part.per_query:
            o = torch.matmul(pp.permute(0, 3, 1, 2, 4), part.v.float())
        else:
            o = torch.einsum("bhgqk,bkhd->bqhgd", pp, part.v.float())
        out = o if out is None else out + o
    return out.flatten(2, 3).to(q.dtype)
