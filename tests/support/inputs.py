"""Seeded random inputs of the operators under test, and the error metric the tests share.

Every function draws from its own ``torch.Generator`` seeded with ``seed``, so a test's inputs
depend on its arguments only::

    xs = kda_inputs(2, 32, 1, 2, 8, 4, seed=0)             # q k [2, 32, 1, 8], v [2, 32, 2, 4],
                                                           # g [2, 32, 2, 8], beta [2, 32, 2]
    xs = kda_inputs(2, 32, 1, 2, 8, 4, seed=0, gate="gdn")  # the same but g [2, 32, 2]
    xs = attention_inputs(0, 1, 16, heads=4, kv_heads=2, dim=8)            # q, k, v
    xs = index_inputs(0, 1, 16)                        # q, k, v, indices and the indexers' inputs
"""

from __future__ import annotations

import torch

#: the operator arguments of :func:`fcp.ops.kda.kda`, in call order
KDA_NAMES = ("q", "k", "v", "g", "beta")
QKV = ("q", "k", "v")


def kda_inputs(batch, seq, heads, value_heads, dk, dv, seed, dtype=torch.float32, gate="kda"):
    """Realistic KDA / Gated DeltaNet inputs (drawn in fp64, then cast): L2-normalised keys,
    beta in (0, 1), log decays in [-8, 0] (mostly small). ``gate="kda"``: ``g [B, L, HV, K]``
    (one decay per key channel); ``gate="gdn"``: ``g [B, L, HV]`` (one per head: the first
    channel of the KDA gate)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = dict(
        q=rand(batch, seq, heads, dk),
        k=torch.nn.functional.normalize(rand(batch, seq, heads, dk), dim=-1),
        v=rand(batch, seq, value_heads, dv),
        g=-8.0 * torch.rand(batch, seq, value_heads, dk, generator=gen, dtype=torch.float64) ** 3,
        beta=torch.rand(batch, seq, value_heads, generator=gen, dtype=torch.float64),
    )
    if gate == "gdn":
        out["g"] = out["g"][..., 0]
    elif gate != "kda":
        raise ValueError(f"kda_inputs: gate must be 'kda' or 'gdn', got {gate!r}")
    return {n: x.to(dtype).contiguous() for n, x in out.items()}


def _qkv(gen, batch, seq, heads, kv_heads, dim, dv, dtype) -> dict[str, torch.Tensor]:
    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return {"q": r(batch, seq, heads, dim), "k": r(batch, seq, kv_heads, dim),
            "v": r(batch, seq, kv_heads, dv)}  # fmt: skip


def attention_inputs(seed, batch, seq, heads=2, kv_heads=1, dim=4, dtype=torch.float32):
    """Softmax attention's q ``[B, L, heads, dim]``, k and v ``[B, L, kv_heads, dim]``."""
    return _qkv(torch.Generator().manual_seed(seed), batch, seq, heads, kv_heads, dim, dim, dtype)


def index_inputs(seed: int, batch: int, seq: int, heads: int = 4, kv_heads: int = 2, dim: int = 8,
                 dv: int = 6, width: int = 6, index_heads: int = 2, index_dim: int = 8,
                 kpool: int = 4, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inputs of index attention and of the two indexers. ``indices [B, L, width]`` hold ids
    in ``[-2, seq + 1]``: -1, out-of-range, future and other-document ids included (the
    operator must drop them)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return {
        **_qkv(g, batch, seq, heads, kv_heads, dim, dv, dtype),
        "indices": torch.randint(-2, seq + 2, (batch, seq, width), generator=g),
        "index_q": r(batch, seq, index_heads, index_dim),
        "index_k": r(batch, seq, index_dim),
        "gate_logits": r(batch, seq, index_dim),
        "ape": r(kpool, index_dim, s=0.5),
        "head_weights": r(batch, seq, index_heads),
        "q_norm": r(index_dim, s=0.3),
        "k_norm": r(index_dim, s=0.3),
    }


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (0 when both are all zero)."""
    a, ref = a.double(), ref.double()
    den = ref.abs().max().item()
    num = (a - ref).abs().max().item()
    return num / den if den else num
