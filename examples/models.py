"""Two tiny hybrid language models written against fcp's operators.

* :class:`Glm5FlashLike` - GLM-5.3-Flash-like: blocks of (short conv -> KDA) alternate with
  DSA sparse attention: GLM-5.3-Flash's k-pool indexer picks each query's tokens, index
  attention reads them from an MLA-style latent.
* :class:`Qwen38FlashNextLike` - Qwen3.8-Flash-Next-like: three KDA blocks per gated compressed
  (ratio 4, block-mean keys plus an exact window) attention block.

Both are plain ``nn.Module`` s over byte tokens (vocabulary 256) whose ``forward`` takes this
rank's token slice and its :class:`fcp.PackedContext`::

    local, ctx = fcp.shard_batch(cp_group, batch, pad_multiple=model.pad_multiple)
    logits = model(local["input_ids"], ctx)                    # [batch, local_seq, 256]
    loss = token_loss_sum(logits, local["shift_labels"]) / n_loss_tokens_of_the_full_batch

The same code runs without CP (``cp_group=None`` or ``fcp.PackedContext(doc_ids)``) and with CP
over any number of ranks: every token-mixing operator (short conv, KDA, the indexer, index and
compressed attention) communicates by itself through the context, except that the DSA mixer
all-gathers its own KV latent (the smallest tensor that determines K and V); everything else
(embeddings, norms, projections, MLPs, the LM head) is per-token and needs nothing. Forward
passes have no host synchronisation and no data-dependent shapes, so
``torch.compile(fullgraph=True)`` traces them once and a new packing never recompiles.

Under CP, parameter gradients are per-rank partial sums: the data-parallel gradient reduction
over the CP ranks (FSDP2 over the data x context mesh in the demo) sums them.

The attention layers use no positional encoding (NoPE): the KDA layers before them carry order,
as in Kimi Linear and GLM-5.3-Flash. The DSA indexer's parameters are frozen: its selection is
discrete and carries no gradient, and GLM-5.3-Flash (transformers, NeMo) trains no indexer loss
(DeepSeek's KL loss for the indexer is orthogonal to context parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fcp import PackedContext, all_gather_sequence, short_conv
from fcp.ops.compressed import compressed_attention
from fcp.ops.index_attention import index_attention
from fcp.ops.kda import kda
from fcp.ops.kpool_indexer import kpool_indexer

__all__ = [
    "IGNORE_INDEX",
    "ModelConfig",
    "HybridLM",
    "Glm5FlashLike",
    "Qwen38FlashNextLike",
    "MODELS",
    "build_model",
    "token_loss_sum",
    "count_loss_tokens",
]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a tiny hybrid model. ``layers`` names each block's token mixer in order:
    ``"kda"`` (short conv -> KDA), ``"sparse"`` (DSA: k-pool indexer + index attention over an
    MLA-style latent) or ``"compressed"`` (gated compressed attention)."""

    vocab_size: int = 256
    d_model: int = 64
    layers: tuple[str, ...] = ("kda", "sparse", "kda", "sparse")
    # KDA
    kda_heads: int = 2
    kda_head_dim: int = 16
    conv_width: int = 4
    chunk_size: int = 64
    # softmax attention
    attn_heads: int = 2
    attn_kv_heads: int = 1
    attn_head_dim: int = 32
    kv_lora_rank: int = 32  # DSA attention: KV latent width (all-gathered under CP)
    kpool: int = 4  # DSA indexer: tokens per pool (pools start at every document start)
    index_topk: int = 32  # DSA indexer: tokens chosen from complete pools (a multiple of kpool)
    index_heads: int = 2  # DSA indexer heads
    index_dim: int = 16  # DSA indexer head dim
    ratio: int = 4  # compressed attention ratio
    window: int = 16  # compressed attention exact window
    # MLP
    mlp_ratio: int = 2
    seed: int = 0  # parameter init seed

    @property
    def pad_multiple(self) -> int:
        """Every rank's local length must be a multiple of this (``shard_batch(pad_multiple=)``)."""
        m = 1  # the DSA indexer works with any local length (pools straddle ranks)
        if "compressed" in self.layers:
            m = math.lcm(m, self.ratio)
        return m


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _linear(d_in: int, d_out: int) -> nn.Linear:
    lin = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(lin.weight, std=d_in**-0.5)
    return lin


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_up = _linear(d, 2 * hidden)
        self.down = _linear(hidden, d)
        nn.init.normal_(self.down.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class KDAMixer(nn.Module):
    """Short causal conv over q/k/v, then Kimi Delta Attention with a gated RMSNorm output.

    One conv over the concatenated q/k/v channels (one left-halo exchange under CP), q and k
    L2-normalised per head, per-channel decay ``g = -exp(A_log) * softplus(W_g x + dt_bias)``
    and step size ``beta = sigmoid(W_b x)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, dk = cfg.kda_heads, cfg.kda_head_dim
        self.h, self.dk, self.chunk = h, dk, cfg.chunk_size
        self.qkv = _linear(cfg.d_model, 3 * h * dk)
        self.conv_weight = nn.Parameter(torch.randn(3 * h * dk, cfg.conv_width) / cfg.conv_width)
        self.gate_proj = _linear(cfg.d_model, h * dk)  # decay gate (per key channel)
        self.beta_proj = _linear(cfg.d_model, h)
        self.out_gate = _linear(cfg.d_model, h * dk)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, h)))
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), h * dk))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.o_norm = RMSNorm(dk)
        self.o_proj = _linear(h * dk, cfg.d_model)
        nn.init.normal_(self.o_proj.weight, std=0.02)

    def forward(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        b, n, _ = x.shape
        h, dk = self.h, self.dk
        qkv = short_conv(self.qkv(x), self.conv_weight, None, ctx, activation="silu")
        q, k, v = qkv.view(b, n, 3, h, dk).unbind(2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        # softplus(z) written as -logsigmoid(-z): the same function, but torch 2.13's
        # aot_eager mis-predicts softplus_backward's output strides when its gradient arrives
        # permuted (as from kda), and the backward graph then fails on a .view
        z = self.gate_proj(x).view(b, n, h, dk) + self.dt_bias.view(h, dk)
        g = self.A_log.exp()[:, None] * F.logsigmoid(-z)  # = -exp(A_log) * softplus(z) <= 0
        beta = torch.sigmoid(self.beta_proj(x))
        o = kda(q, k, v, g, beta, ctx, chunk_size=self.chunk)
        o = self.o_norm(o) * torch.sigmoid(self.out_gate(x).view(b, n, h, dk))
        return self.o_proj(o.reshape(b, n, h * dk))


class _AttentionBase(nn.Module):
    """q/k/v projections with per-head QK RMSNorm (GQA), a sigmoid output gate, out projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.dh = cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim
        self.q_proj = _linear(cfg.d_model, self.h * self.dh)
        self.kv_proj = _linear(cfg.d_model, 2 * self.hkv * self.dh)
        self.q_norm, self.k_norm = RMSNorm(self.dh), RMSNorm(self.dh)
        self.gate = _linear(cfg.d_model, self.h * self.dh)
        self.o_proj = _linear(self.h * self.dh, cfg.d_model)
        nn.init.normal_(self.o_proj.weight, std=0.02)

    def qkv(self, x: torch.Tensor):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.h, self.dh))
        k, v = self.kv_proj(x).view(b, n, 2, self.hkv, self.dh).unbind(2)
        return q, self.k_norm(k), v

    def out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        o = o.reshape(b, n, self.h * self.dh) * torch.sigmoid(self.gate(x))
        return self.o_proj(o)


class SparseAttentionMixer(nn.Module):
    """GLM-5.3-Flash-like DSA attention: a k-pool indexer picks ``index_topk`` tokens from the
    query's complete pools of ``kpool`` tokens (plus its incomplete pool, the tail), and every
    head attends to exactly those tokens.

    Keys and values come from an MLA-style latent ``c = RMSNorm(W_a x)`` (``kv_lora_rank`` per
    token) expanded per head by ``W_b``: under CP each rank all-gathers ``c`` and expands it
    (``index_attention(..., kv="global")``), so the latent, not the per-head K/V, crosses
    ranks. The indexer has its own frozen projections (queries, LayerNorm'd keys, per-channel
    pool gate logits and position embedding, head weights), as GLM-5.3-Flash's does.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, dh = cfg.d_model, cfg.attn_heads, cfg.attn_head_dim
        hi, di = cfg.index_heads, cfg.index_dim
        self.h, self.dh, self.hi, self.di = h, dh, hi, di
        self.kpool, self.index_topk = cfg.kpool, cfg.index_topk
        self.q_proj = _linear(d, h * dh)
        self.q_norm = RMSNorm(dh)
        self.kv_a = _linear(d, cfg.kv_lora_rank)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b = _linear(cfg.kv_lora_rank, h * 2 * dh)
        self.o_proj = _linear(h * dh, d)
        nn.init.normal_(self.o_proj.weight, std=0.02)
        self.index_q = _linear(d, hi * di)
        self.index_k = _linear(d, di)
        self.index_k_norm = nn.LayerNorm(di, eps=1e-6)
        self.index_w = _linear(d, hi)
        self.pool_gate = _linear(d, di)
        self.pool_ape = nn.Parameter(torch.randn(cfg.kpool, di) * 0.1)
        for module in (self.index_q, self.index_k, self.index_k_norm, self.index_w, self.pool_gate):
            module.requires_grad_(False)
        self.pool_ape.requires_grad_(False)

    def forward(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.h, self.dh))
        latent = all_gather_sequence(self.kv_norm(self.kv_a(x)), ctx)  # [b, global_seq, r]
        k, v = self.kv_b(latent).view(b, -1, self.h, 2 * self.dh).chunk(2, -1)
        indices = kpool_indexer(
            self.index_q(x).view(b, n, self.hi, self.di),
            self.index_k_norm(self.index_k(x)),
            self.pool_gate(x),
            self.pool_ape,
            self.index_w(x) * self.hi**-0.5,
            ctx,
            topk=self.index_topk,
            kpool=self.kpool,
        )
        o = index_attention(q, k, v, indices, ctx, kv="global")
        return self.o_proj(o.reshape(b, n, self.h * self.dh))


class CompressedAttentionMixer(_AttentionBase):
    """Gated compressed attention: block means of every ``ratio`` keys plus an exact window."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.ratio, self.window = cfg.ratio, cfg.window

    def forward(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        q, k, v = self.qkv(x)
        o = compressed_attention(q, k, v, ctx, ratio=self.ratio, window=self.window)
        return self.out(x, o)


_MIXERS = {"kda": KDAMixer, "sparse": SparseAttentionMixer, "compressed": CompressedAttentionMixer}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        if kind not in _MIXERS:
            raise ValueError(f"unknown layer kind {kind!r}; expected one of {sorted(_MIXERS)}")
        self.kind = kind
        self.norm1, self.norm2 = RMSNorm(cfg.d_model), RMSNorm(cfg.d_model)
        self.mixer = _MIXERS[kind](cfg)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_ratio * cfg.d_model)

    def forward(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x), ctx)
        return x + self.mlp(self.norm2(x))


class HybridLM(nn.Module):
    """Embedding -> blocks -> RMSNorm -> LM head. ``forward(input_ids, ctx) -> logits``."""

    default_config = ModelConfig()

    def __init__(self, cfg: ModelConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or self.default_config
        if overrides:
            cfg = replace(cfg, **overrides)
        self.cfg = cfg
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)  # same seed, same weights, on every rank and the twin
        try:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            nn.init.normal_(self.embed.weight, std=1.0)
            self.blocks = nn.ModuleList(Block(cfg, kind) for kind in cfg.layers)
            self.norm = RMSNorm(cfg.d_model)
            self.head = _linear(cfg.d_model, cfg.vocab_size)
            nn.init.normal_(self.head.weight, std=0.02)  # start near the uniform ln(256)
        finally:
            torch.random.set_rng_state(gen_state)

    @property
    def pad_multiple(self) -> int:
        return self.cfg.pad_multiple

    def mixers(self) -> list[nn.Module]:
        """The token mixers (the fcp-backed modules the demo compiles)."""
        return [block.mixer for block in self.blocks]

    def forward(self, input_ids: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, ctx)
        logits = self.head(self.norm(x))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


class Glm5FlashLike(HybridLM):
    """GLM-5.3-Flash-like: (short conv -> KDA) blocks alternating with DSA attention blocks
    (k-pool indexer: pools of 4, 32 tokens from complete pools plus the tail per query)."""

    default_config = ModelConfig(layers=("kda", "sparse", "kda", "sparse"))


class Qwen38FlashNextLike(HybridLM):
    """Qwen3.8-Flash-Next-like: three KDA blocks per gated compressed-attention block (ratio 4,
    exact window 16)."""

    default_config = ModelConfig(layers=("kda", "kda", "kda", "compressed"))


MODELS = {"glm5": Glm5FlashLike, "qwen3": Qwen38FlashNextLike}


def build_model(name: str, **overrides) -> HybridLM:
    """``build_model("glm5" | "qwen3", **config_overrides)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    return MODELS[name](**overrides)


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the next-token cross entropies of the labelled tokens in ``logits``
    against ``shift_labels`` (the next-token targets, aligned with the tokens, as
    :func:`fcp.shard_batch` builds them).

    Divide by the number of labelled tokens of the **full** batch (:func:`count_loss_tokens`),
    so that the per-rank losses of a CP step add up to the non-CP mean loss.
    """
    return F.cross_entropy(
        logits.flatten(0, 1), shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def count_loss_tokens(shift_labels: torch.Tensor) -> int:
    """Labelled tokens of a (replicated, full) batch: the global loss denominator."""
    return int((shift_labels != IGNORE_INDEX).sum())
