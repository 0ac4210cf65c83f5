"""transformers models on fcp: packed documents and contiguous CP by module replacement.

:func:`enable_packed_cp` walks a transformers model and replaces, in place, its token mixers by
fcp-backed modules that **adopt** the original modules' parameters (same attribute names, so the
same state-dict keys: transformers checkpoints load unchanged). Everything else of the model
(embeddings, norms, hyper-connections, MLPs and MoEs) is per token and stays as it is. Then::

    model = fcp.integrations.hf.enable_packed_cp(model)      # the same object, returned
    local, ctx = fcp.shard_batch(cp_mesh, batch)             # batch: packed rows + seq_lens, ...
    out = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)

computes every packed document exactly as transformers computes that document alone (a batch of
one, no padding), and under CP each rank returns its contiguous shard of that. Without
``cp_context`` a replaced module runs the original transformers code.

Supported mixers (:data:`SUPPORTED`), and what each exchanges under CP (every linear-attention
layer: a ``(W - 1)``-token left halo of its conv input and one fp32 state-chain all-gather of
``[batch, value_heads, K, K + V]``; nothing else):

* GLM-5.3-Flash (``glm5_next``): ``Glm5NextTextLinearAttention`` (short conv -> KDA with its
  forget gate and gated output norm) and ``Glm5NextTextAttention`` (k-pool DSA indexer + MLA over
  the selected tokens, with cross-layer top-k sharing). Under CP the MLA layer all-gathers its
  compressed KV latent (``kv_lora_rank`` per token) and expands it locally, and the indexer
  all-gathers its pooled keys: never the expanded K/V or the hidden states.
* Kimi-Linear (``kimi_linear``): ``KimiLinearDeltaAttention`` (the same KDA layer, per-channel
  gate) and ``KimiLinearAttention`` (NoPE MLA, full causal attention within each document by
  :func:`fcp.ops.doc_causal_attention`). Under CP the MLA layer all-gathers its
  expanded K/V (``heads * (qk_head_dim + v_head_dim)`` per token).
* Qwen3-Next (``qwen3_next``): ``Qwen3NextGatedDeltaNet`` (interleaved ``in_proj_qkvz`` /
  ``in_proj_ba`` projections, short conv over q/k/v, Gated DeltaNet: :func:`fcp.ops.kda.kda` with
  one gate per value head and q/k shared by ``value_heads // key_heads`` value heads, then the
  SiLU-gated RMSNorm) and ``Qwen3NextAttention`` (gated GQA full attention with q/k RMSNorm and
  partial RoPE). RoPE is applied at **document-local** positions (``cp_context``'s
  ``local_position_ids``, through the model's own ``rotary_emb``, which the replacement borrows
  from the enclosing model), so each document sees the angles it sees alone. Under CP the
  attention layer all-gathers its K/V (``2 * kv_heads * head_dim`` per token, K already rotated).

transformers binds these models' recurrent kernels to FLA's Triton kernels whenever FLA is
importable (they fail on a CPU); the replaced modules never take that path when given a
``cp_context``: they run fcp's operators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.conv import short_conv
from fcp.ops.index_attention import index_attention
from fcp.ops.kda import kda
from fcp.ops.kpool_indexer import kpool_indexer

__all__ = [
    "SUPPORTED",
    "enable_packed_cp",
    "PackedGlm5LinearAttention",
    "PackedGlm5Attention",
    "PackedKimiDeltaAttention",
    "PackedKimiAttention",
    "PackedQwen3NextGatedDeltaNet",
    "PackedQwen3NextAttention",
]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' KDA ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + eps)`` in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _conv_activation(activation: str) -> str:
    """The layer's conv activation as :func:`fcp.ops.conv.short_conv` names it (SiLU only)."""
    if activation not in ("silu", "swish"):
        raise NotImplementedError(f"fcp's short conv applies SiLU; this layer uses {activation!r}")
    return "silu"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``R = cos.shape[-1]`` channels of every head (the rest pass
    through), with the halves convention of transformers' ``rotate_half``: channel ``i < R/2``
    pairs with ``i + R/2``. ``x [B, L, H, D]``, ``cos``/``sin`` ``[B, L, R]``."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]
    rot, rest = x[..., :r], x[..., r:]
    first, second = rot[..., : r // 2], rot[..., r // 2 :]
    turned = torch.cat([-second, first], -1)
    return torch.cat([rot * cos + turned * sin, rest], -1)


def _context(kwargs: dict) -> PackedContext | None:
    ctx = kwargs.pop("cp_context", None)
    if ctx is not None and not isinstance(ctx, PackedContext):
        raise TypeError(f"cp_context must be an fcp.PackedContext, got {type(ctx).__name__}")
    return ctx


class _Adopted(nn.Module):
    """A module that takes over another module's state (parameters, buffers, submodules and
    attributes, under the same names) and keeps its class's methods for the non-fcp path: an
    attribute this class lacks is looked up on the original class (bound to this module)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.__dict__.update(original.__dict__)
        self._hf_class = type(original)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            hf_class = self.__dict__.get("_hf_class")
            attr = getattr(hf_class, name, None) if hf_class is not None else None
            if attr is None:
                raise
            return attr.__get__(self) if hasattr(attr, "__get__") else attr

    def _hf_forward(self, *args, **kwargs):
        return self._hf_class.forward(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return "fcp-backed (packed documents, contiguous CP)"


class PackedGlm5LinearAttention(_Adopted):
    """GLM-5.3-Flash's KDA layer (``Glm5NextTextLinearAttention``) on fcp's operators.

    ``forward(hidden_states [B, L, D], cache=None, attention_mask=None, cp_context=None, ...)``:
    with a ``cp_context``, this rank's ``[B, local_seq, D]`` shard: q/k/v projections, the
    document-masked causal conv (:func:`fcp.ops.conv.short_conv`, its halo crosses ranks),
    the forget gate, ``beta``, L2-normalised q/k, :func:`fcp.ops.kda.kda` (state chained across
    ranks), the gated RMSNorm and the output projection.
    """

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        ctx = _context(kwargs)
        if ctx is None:
            return self._hf_forward(hidden_states, cache=cache, attention_mask=attention_mask,
                                    **kwargs)  # fmt: skip
        b, n, _ = hidden_states.shape
        shape = (b, n, -1, self.head_dim)
        qkv = torch.cat(
            [self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1
        )
        qkv = short_conv(qkv, self.conv1d.weight[:, 0, :], self.conv1d.bias, ctx,
                         activation=_conv_activation(self.activation))  # fmt: skip
        q, k, v = torch.split(qkv, [self.qkv_dim] * 3, dim=-1)
        g = self.forget_gate(hidden_states)
        beta = torch.sigmoid(self.b_proj(hidden_states))
        o = kda(_l2norm(q.view(shape)), _l2norm(k.view(shape)), v.view(shape), g, beta, ctx,
                scale=self.head_dim**-0.5)  # fmt: skip
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(shape)
        o = self.o_norm(o.to(hidden_states.dtype), gate).reshape(b, n, -1)
        return self.o_proj(o)


class PackedGlm5Attention(_Adopted):
    """GLM-5.3-Flash's indexed attention (``Glm5NextTextAttention``) on fcp's operators.

    ``forward(hidden_states [B, L, D], attention_mask, cache=None, prev_topk_indices=None,
    cp_context=None, ...) -> (out, None, topk or None)``: with a ``cp_context``, the k-pool
    indexer (:func:`fcp.ops.kpool_indexer.kpool_indexer`, no gradient) selects global token ids
    (or a previous layer's selection is reused on "shared" layers), the compressed KV latent is
    all-gathered and expanded, and :func:`fcp.ops.index_attention.index_attention` attends to
    exactly the selected tokens (NoPE MLA, scale ``qk_head_dim ** -0.5``).
    """

    def forward(self, hidden_states, attention_mask=None, cache=None, prev_topk_indices=None,
                **kwargs):  # fmt: skip
        ctx = _context(kwargs)
        if ctx is None:
            return self._hf_forward(hidden_states, attention_mask, cache=cache,
                                    prev_topk_indices=prev_topk_indices, **kwargs)  # fmt: skip
        if self.qk_rope_head_dim:
            raise NotImplementedError("GLM-5.3-Flash is NoPE (qk_rope_head_dim == 0)")
        b, n, _ = hidden_states.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid).view(b, n, self.num_heads, self.qk_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden_states))  # [B, L, r]
        latent = all_gather_sequence(latent, ctx, dtype=torch.float32).to(latent.dtype)  # [B, S, r]
        kv = self.kv_b_proj(latent).view(b, latent.shape[1], self.num_heads, -1)
        k, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if self.indexer is not None:
            topk = _kpool_select(self.indexer, hidden_states, q_resid, ctx)
        elif prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full "
                             "indexer layer.")  # fmt: skip
        else:
            topk = prev_topk_indices
        o = index_attention(q, k, v, topk, ctx, scale=self.scaling, kv="global")
        out = self.o_proj(o.reshape(b, n, -1))
        return out, None, topk if self.next_skip_topk else None


class PackedKimiDeltaAttention(PackedGlm5LinearAttention):
    """Kimi-Linear's KDA layer (``KimiLinearDeltaAttention``) on fcp's operators.

    The same layer as GLM-5.3-Flash's (:class:`PackedGlm5LinearAttention`: projections, short
    conv, per-channel forget gate, ``beta``, L2-normalised q/k, :func:`fcp.ops.kda.kda`, gated
    RMSNorm, output projection), with Kimi's module names and its own forget gate module.
    """


class PackedKimiAttention(_Adopted):
    """Kimi-Linear's full attention (``KimiLinearAttention``: NoPE MLA) on fcp's operators.

    ``forward(hidden_states [B, L, D], attention_mask, cache=None, cp_context=None, ...) ->
    (out, None)``: with a ``cp_context``, the queries (``q_proj``, or the ``q_lora_rank`` path),
    the KV latent and its shared rope-part key, K/V expanded per head, then causal softmax
    attention within each document (:func:`fcp.ops.doc_causal_attention`, scale
    ``qk_head_dim ** -0.5``). No positional rotation: the layer is NoPE, as in transformers.
    """

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        ctx = _context(kwargs)
        if ctx is None:
            return self._hf_forward(hidden_states, attention_mask, cache=cache, **kwargs)
        b, n, _ = hidden_states.shape
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(b, n, -1, self.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        latent, k_rope = torch.split(latent, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(b, n, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, k_nope.shape[2], -1)], -1)
        o = doc_causal_attention(q, k, v, ctx, scale=self.scaling)
        return self.o_proj(o.reshape(b, n, -1)), None


class PackedQwen3NextGatedDeltaNet(_Adopted):
    """Qwen3-Next's Gated DeltaNet layer (``Qwen3NextGatedDeltaNet``) on fcp's operators.

    ``forward(hidden_states [B, L, D], cache=None, attention_mask=None, cp_context=None, ...)``:
    with a ``cp_context``, the interleaved projections (``in_proj_qkvz`` holds, per key head
    ``j``, ``[q_j | k_j | v and z of value heads j r .. j r + r - 1]`` with ``r = value_heads //
    key_heads``; ``in_proj_ba`` likewise ``[b | a]``), the document-masked short conv over q/k/v
    (:func:`fcp.ops.conv.short_conv`), ``beta = sigmoid(b)``, one decay per value head ``g =
    -exp(A_log) * softplus(a + dt_bias)`` (fp32), L2-normalised q/k, :func:`fcp.ops.kda.kda` with
    that scalar gate (value head ``h`` reads key head ``h // r``: transformers'
    ``repeat_interleave``), the SiLU-gated RMSNorm with ``z`` and the output projection.
    """

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        ctx = _context(kwargs)
        if ctx is None:
            return self._hf_forward(hidden_states, cache=cache, attention_mask=attention_mask,
                                    **kwargs)  # fmt: skip
        b, n, _ = hidden_states.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = hv // hk
        qkvz = self.in_proj_qkvz(hidden_states).view(b, n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        beta_logit, a = torch.split(self.in_proj_ba(hidden_states).view(b, n, hk, 2 * r), [r, r],
                                    dim=-1)  # fmt: skip
        qkv = torch.cat([q.reshape(b, n, -1), k.reshape(b, n, -1), v.reshape(b, n, -1)], -1)
        qkv = short_conv(qkv, self.conv1d.weight[:, 0, :], self.conv1d.bias, ctx,
                         activation=_conv_activation(self.activation))  # fmt: skip
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = beta_logit.reshape(b, n, hv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(b, n, hv).float() + self.dt_bias)
        o = kda(_l2norm(q.view(b, n, hk, dk)), _l2norm(k.view(b, n, hk, dk)), v.view(b, n, hv, dv),
                g, beta, ctx, scale=dk**-0.5)  # fmt: skip
        o = self.norm(o.to(hidden_states.dtype), z.reshape(b, n, hv, dv))
        return self.out_proj(o.reshape(b, n, -1))


class PackedQwen3NextAttention(_Adopted):
    """Qwen3-Next's gated full attention (``Qwen3NextAttention``) on fcp's operators.

    ``forward(hidden_states [B, L, D], position_embeddings, attention_mask, cache=None,
    cp_context=None, ...) -> (out, None)``: with a ``cp_context``, ``q_proj`` split per head into
    the query and its output gate, q/k RMSNorm, RoPE (partial: the first ``rotary_dim`` channels)
    at the tokens' **document-local** positions (``cp_context.local_position_ids``, cos/sin from
    the model's own rotary embedding module; the ``position_embeddings`` transformers passes,
    computed at row positions, are ignored), causal GQA attention within each document
    (:func:`fcp.ops.doc_causal_attention`, scale ``head_dim ** -0.5``), the sigmoid
    output gate and ``o_proj``.

    :func:`enable_packed_cp` hands it the rotary embedding of the enclosing model
    (:meth:`bind_rotary`); it is referenced, not registered as a submodule, so module and
    state-dict names are unchanged.
    """

    needs_rotary = True

    def bind_rotary(self, rotary: nn.Module) -> None:
        """Use ``rotary(x, position_ids) -> (cos, sin)`` (the model's ``rotary_emb``)."""
        object.__setattr__(self, "fcp_rotary", rotary)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):  # fmt: skip
        ctx = _context(kwargs)
        if ctx is None:
            return self._hf_forward(hidden_states, position_embeddings, attention_mask,
                                    cache=cache, **kwargs)  # fmt: skip
        b, n, _ = hidden_states.shape
        d = self.head_dim
        q, gate = torch.chunk(self.q_proj(hidden_states).view(b, n, -1, 2 * d), 2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden_states).view(b, n, -1, d))
        v = self.v_proj(hidden_states).view(b, n, -1, d)
        cos, sin = self.fcp_rotary(hidden_states, ctx.local_position_ids)
        o = doc_causal_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, ctx,
                                 scale=self.scaling)  # fmt: skip
        o = o.reshape(b, n, -1) * torch.sigmoid(gate.reshape(b, n, -1))
        return self.o_proj(o), None


def _kpool_select(indexer: nn.Module, x: torch.Tensor, q_resid: torch.Tensor, ctx) -> torch.Tensor:
    """transformers' ``Glm5NextTextIndexer`` projections, then fcp's k-pool selection."""
    with torch.no_grad():
        b, n, _ = x.shape
        index_q = indexer.wq_b(q_resid).view(b, n, indexer.n_heads, indexer.head_dim)
        index_k = indexer.k_norm(indexer.wk(x))
        gate = F.linear(x, indexer.index_kpool_compress_gate)
        weights = indexer.weights_proj(x).float() * indexer.n_heads**-0.5
        width = indexer.index_topk
        return kpool_indexer(index_q, index_k, gate, indexer.index_kpool_compress_ape, weights, ctx,
                             topk=width, kpool=indexer.index_kpool,
                             select_tail=indexer.index_kpool_always_select_tail,
                             scale=indexer.softmax_scale)  # fmt: skip


#: transformers class name -> the fcp-backed replacement.
SUPPORTED: dict[str, type[_Adopted]] = {
    "Glm5NextTextLinearAttention": PackedGlm5LinearAttention,
    "Glm5NextTextAttention": PackedGlm5Attention,
    "KimiLinearDeltaAttention": PackedKimiDeltaAttention,
    "KimiLinearAttention": PackedKimiAttention,
    "Qwen3NextGatedDeltaNet": PackedQwen3NextGatedDeltaNet,
    "Qwen3NextAttention": PackedQwen3NextAttention,
}


def enable_packed_cp(model: nn.Module) -> nn.Module:
    """Replace ``model``'s supported token mixers (:data:`SUPPORTED`) in place; return ``model``.

    ``model`` is a transformers model or any module containing one (e.g. a
    ``Glm5NextForConditionalGeneration``, ``KimiLinearForCausalLM``, ``Qwen3NextForCausalLM``).
    Parameters, buffers and their names are kept (the replacement adopts the original module's
    state), so optimizers built before the call, ``state_dict()`` keys and checkpoints stay
    valid. A mixer that applies RoPE (Qwen3-Next's attention) borrows the ``rotary_emb`` of the
    nearest enclosing module that has one (``ValueError`` if none does). Idempotent. Raises
    ``ValueError`` if nothing was replaced.
    """
    rotary_of: dict[int, nn.Module] = {}  # module id -> rotary embedding of its nearest model
    for owner in model.modules():  # pre-order: an inner model's entry overrides an outer one's
        rotary = dict(owner.named_children()).get("rotary_emb")
        if rotary is not None:
            rotary_of.update((id(m), rotary) for m in owner.modules())
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            cls = SUPPORTED.get(type(child).__name__)
            if cls is not None and not isinstance(child, _Adopted):
                new = cls(child)
                if getattr(cls, "needs_rotary", False):
                    if id(child) not in rotary_of:
                        raise ValueError(
                            f"enable_packed_cp: {type(child).__name__} applies RoPE but no "
                            f"enclosing module has a `rotary_emb` (pass the whole model)"
                        )
                    new.bind_rotary(rotary_of[id(child)])
                setattr(parent, name, new)
                replaced += 1
    if not replaced and not any(isinstance(m, _Adopted) for m in model.modules()):
        raise ValueError(
            f"enable_packed_cp: {type(model).__name__} has no supported token mixer "
            f"(supported: {sorted(SUPPORTED)})"
        )
    return model
