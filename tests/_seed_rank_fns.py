"""Functions run on pool ranks by the seed-adapter tests: fcp's adapters next to NeMo AutoModel's
cp modules on the same real gloo group (importable by module path)."""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.layout import doc_ids_from_cu_seqlens
from fcp.models.glm5_next import cp as glm
from fcp.models.qwen3_8_flash_next import cp as qwen
from tests.support.nemo_diff import (
    assert_same,
    batch_untouched,
    check,
    describe,
    nemo_modules,
    outcome,
)


def _slice(full: torch.Tensor, env, dim: int = 1) -> torch.Tensor:
    n = full.shape[dim] // env.world_size
    return full.narrow(dim, env.rank * n, n)


# ---------------------------------------------------------------------------------- sharders
def shard_diff(env, model: str, case, kwargs: dict) -> str:
    """Both sharders on this rank's real mesh; the contract of ``tests.support.nemo_diff.check``."""
    mesh = env.mesh()
    nemo_glm, nemo_qwen = nemo_modules()
    ours, theirs = (glm, nemo_glm) if model == "glm" else (qwen, nemo_qwen)
    name = "shard_batch_for_" + ("glm5_next_cp" if model == "glm" else "qwen3_8_flash_next_cp")
    n = outcome(getattr(theirs, name), mesh, None, share=(mesh,), **kwargs)
    f = outcome(getattr(ours, name), mesh, None, share=(mesh,), **kwargs)
    verdict = check(n, f, ours.__doc__, case, what=f"rank {env.rank} {name}")
    if f.error is not None:
        batch_untouched(kwargs["batch"], f.kwargs["batch"])
    if f.error is None:  # fcp's view of the context works with fcp's collectives
        if model == "glm":
            core = f.value[1]["glm5_next_packed_context"].to_packed_context(mesh)
        else:
            ctx = f.value[1]["_qwen3_8_flash_next_cp_context"]
            core = ctx.packed_context
            if ctx.global_cu_seqlens is not None:  # compile-safe map == the core's host map
                want = doc_ids_from_cu_seqlens(ctx.global_cu_seqlens, core.global_seq_len)
                assert torch.equal(core.doc_ids, want), (core.doc_ids, want)
        assert (core.cp_rank, core.cp_size) == (env.rank, env.world_size)
        assert torch.equal(all_gather_sequence(core.local_doc_ids, core), core.doc_ids)
    return verdict


# ---------------------------------------------------------------------------------- GLM-5.3
def glm_gather_diff(env, full: torch.Tensor, dim: int, use_function: bool):
    """NeMo's and fcp's gathers: values and gradients (integer-valued, so sums are exact)."""
    nemo_glm, _ = nemo_modules()
    out = []
    for mod in (nemo_glm, glm):
        x = _slice(full, env, dim % full.dim()).clone().requires_grad_()
        if use_function:
            g = mod._AllGatherSequence.apply(x, env.group, dim)
        else:
            g = mod.all_gather_sequence(x, env.group, dim=dim)
        w = torch.arange(g.numel(), dtype=g.dtype).view_as(g) * (env.rank + 1)
        (g * w).sum().backward()
        out.append((g.detach(), x.grad))
        ints = _slice(full, env, dim % full.dim()).long()
        out.append(mod.all_gather_sequence(ints, env.group, dim=dim))
    assert_same(out[:2], out[2:], "all_gather_sequence")
    return describe(out[2:])


def glm_anchor_diff(env, full: torch.Tensor):
    """Rank 0's loss ignores the gather but for the anchor: both keep it in the backward."""
    nemo_glm, _ = nemo_modules()
    out = []
    for mod in (nemo_glm, glm):
        x = _slice(full, env).clone().requires_grad_()
        g = mod.all_gather_sequence(x, env.group)
        anchor = mod.all_gather_backward_anchor(g)
        if env.rank == 0:
            loss = (x * 2).sum() + anchor.sum()
        else:
            loss = (g * torch.arange(g.numel(), dtype=g.dtype).view_as(g)).sum() + anchor.sum()
        loss.backward()
        out.append((anchor.detach(), anchor.requires_grad, x.grad))
    assert_same(out[0], out[1], "all_gather_backward_anchor")
    return describe(out[1])


def glm_fla_diff(env, doc_ids: torch.Tensor, conv: int):
    """``build_fla_cp_context`` of every row: FLA's own builder (NeMo) versus fcp's planner."""
    nemo_glm, _ = nemo_modules()
    local = doc_ids.shape[1] // env.world_size
    kw = dict(seq_start=env.rank * local, cp_size=env.world_size, original_seq_len=None)
    theirs = nemo_glm.Glm5NextPackedContext(doc_ids.to(torch.int32), **kw)
    ours = glm.Glm5NextPackedContext(doc_ids.to(torch.int32), **kw)
    fields = ("cu_seqlens", "cu_seqlens_cpu", "is_last_rank", "pre_num_ranks", "is_first_rank",
              "post_num_ranks", "conv1d_kernel_size", "pre_num_conv_tokens", "layout")  # fmt: skip
    result = []
    for row in range(doc_ids.shape[0]):
        n = nemo_glm.build_fla_cp_context(theirs, row, env.group, conv)
        f = glm.build_fla_cp_context(ours, row, env.group, conv)
        assert n.group is f.group is env.group
        assert_same({k: getattr(n, k) for k in fields}, {k: getattr(f, k) for k in fields},
                    f"FLACPContext row {row}")  # fmt: skip
        result.append({k: getattr(f, k) for k in fields})
    return describe(result)


# ---------------------------------------------------------------------------------- Qwen3.8
def _contexts(env, nemo_qwen, seq_len: int, pad_multiple: int):
    batch = {"input_ids": torch.zeros(1, seq_len, dtype=torch.long),
             "labels": torch.zeros(1, seq_len, dtype=torch.long)}  # fmt: skip
    mesh = env.mesh()
    out = []
    for mod in (nemo_qwen, qwen):
        _, local, _ = mod.shard_batch_for_qwen3_8_flash_next_cp(
            mesh, None, dict(batch), pad_multiple=pad_multiple
        )
        out.append(local["_qwen3_8_flash_next_cp_context"])
    return out


def qwen_gather_diff(env, full: torch.Tensor, dim: int, differentiable: bool, compress: int):
    """All-gathers of a (compressed) local stream: values, ``requires_grad`` and gradients."""
    _, nemo_qwen = nemo_modules()
    contexts = _contexts(env, nemo_qwen, full.shape[1] * compress, 2)
    out = []
    for mod, ctx in zip((nemo_qwen, qwen), contexts):
        x = _slice(full, env).clone().requires_grad_()
        src = x.movedim(1, dim % full.dim())
        g = mod.qwen3_8_flash_next_cp_all_gather(src, ctx, sequence_dim=dim,
                                                 differentiable=differentiable)  # fmt: skip
        grad = None
        if g.requires_grad:
            w = torch.arange(g.numel(), dtype=g.dtype).view_as(g) * (env.rank + 1)
            (g * w).sum().backward()
            grad = x.grad
        out.append((g.detach(), g.requires_grad, grad))
    assert_same(out[0], out[1], "qwen3_8_flash_next_cp_all_gather")
    return describe(out[1])


def qwen_halo_diff(env, full: torch.Tensor, history: int):
    """Left halos of every rank: values, shape and gradients back to the owning ranks."""
    _, nemo_qwen = nemo_modules()
    contexts = _contexts(env, nemo_qwen, full.shape[1], 2)
    out = []
    for mod, ctx in zip((nemo_qwen, qwen), contexts):
        x = _slice(full, env).clone().requires_grad_()
        halo = mod.qwen3_8_flash_next_cp_left_halo(x, ctx, history=history)
        grad = None
        if halo.requires_grad:
            w = torch.arange(halo.numel(), dtype=halo.dtype).view_as(halo) + env.rank
            (halo * w).sum().backward()
            grad = x.grad
        out.append((halo.detach(), grad))
    assert_same(out[0], out[1], "qwen3_8_flash_next_cp_left_halo")
    return describe(out[1])


def qwen_context_diff(env, case, kwargs: dict) -> str:
    """Context construction on the real group: rank 0's fields shifted to this rank."""
    _, nemo_qwen = nemo_modules()
    kwargs = dict(kwargs)
    local = kwargs["global_input_ids"].shape[1] // env.world_size
    kwargs["rank"] = kwargs["rank"] + env.rank
    kwargs["local_sequence_start"] = kwargs["local_sequence_start"] + env.rank * local
    if kwargs.get("group") == "group":
        kwargs["group"] = env.group
    n = outcome(nemo_qwen.Qwen3_8_FlashNextCPContext, share=(env.group,), **kwargs)
    f = outcome(qwen.Qwen3_8_FlashNextCPContext, share=(env.group,), **kwargs)
    return check(n, f, qwen.__doc__, case, compare_args=False, what=f"rank {env.rank} context")
