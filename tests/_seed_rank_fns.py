"""Functions run on pool ranks by the seed-adapter tests (importable by module path)."""

from __future__ import annotations

import torch

from fcp.models.glm5_next import cp as glm
from fcp.models.qwen3_8_flash_next import cp as qwen


def _slice(full: torch.Tensor, env, dim: int = 1) -> torch.Tensor:
    n = full.shape[dim] // env.world_size
    return full.narrow(dim, env.rank * n, n)


# ---------------------------------------------------------------------------------- GLM-5.3
def glm_shard(env, batch: dict, shard_primary: bool, loss_mask):
    mesh = env.mesh()
    factory, local, layout = glm.shard_batch_for_glm5_next_cp(
        mesh, None, batch, loss_mask=loss_mask, padding_token_id=99, shard_primary=shard_primary
    )
    with factory():
        pass
    ctx = local.pop("cp_context")
    core = layout.to_packed_context(mesh)
    return {
        "local": local,
        "ctx": (type(ctx).__name__, ctx.cp_size, ctx.cp_rank, ctx.interval, ctx.original_seq_len),
        "ctx_doc_ids": ctx.doc_ids,
        "layout": (type(layout).__name__, layout.seq_start, layout.cp_size, layout.local_seq_len,
                   layout.original_seq_len, layout.cp_enabled),
        "layout_local_doc_ids": layout.local_doc_ids,
        "layout_row0": layout.row_cu_seqlens(0),
        "core_is_ctx": core is ctx,
        "memo_shared": layout.row_cu_seqlens(0)[1] is ctx.row_cu_seqlens(0)[1],
        "batch_after": batch,
    }


def glm_gather_grad(env, full: torch.Tensor, use_function: bool):
    x = _slice(full, env).clone().requires_grad_()
    if use_function:
        g = glm._AllGatherSequence.apply(x, env.group, 1)
    else:
        g = glm.all_gather_sequence(x, env.group, 1)
    w = torch.arange(g.numel(), dtype=g.dtype).view_as(g)
    (g * w).sum().backward()
    return g, x.grad


def glm_anchor(env, full: torch.Tensor):
    """Rank 0's loss ignores the gather; the anchor keeps it in the backward reduce-scatter."""
    x = _slice(full, env).clone().requires_grad_()
    g = glm.all_gather_sequence(x, env.group)
    w = torch.arange(g.numel(), dtype=g.dtype).view_as(g)
    if env.rank == 0:
        anchor = glm.all_gather_backward_anchor(g)
        loss = x.sum() + anchor
    else:
        anchor = None
        loss = (g * w).sum()
    loss.backward()
    return anchor, x.grad


# ---------------------------------------------------------------------------------- Qwen3.8
def _ctx_fields(ctx):
    return {
        "group_is_none": ctx.group is None,
        "rank": ctx.rank,
        "size": ctx.size,
        "global_input_ids": ctx.global_input_ids,
        "global_padding_mask": ctx.global_padding_mask,
        "start": ctx.local_sequence_start,
        "length": ctx.local_sequence_length,
        "end": ctx.local_sequence_end,
        "cu": ctx.global_cu_seqlens,
        "global_sequence_length": ctx.global_sequence_length,
        "global_sequence_lengths": ctx.global_sequence_lengths,
    }


def qwen_shard(env, batch: dict, pad_multiple: int):
    mesh = env.mesh()
    factory, local, layout = qwen.shard_batch_for_qwen3_8_flash_next_cp(
        mesh, None, batch, pad_multiple=pad_multiple
    )
    ctx = local.pop("cp_context")
    return {
        "local": local,
        "ctx": _ctx_fields(ctx),
        "packed_doc_ids": ctx.packed_context.doc_ids,
        "packed": (ctx.packed_context.cp_rank, ctx.packed_context.interval),
        "layout": (type(layout).__name__, layout.cp_size, layout.cp_rank, layout.interval,
                   layout.original_seq_len),
        "layout_doc_ids": layout.doc_ids,
        "gathered_ids": qwen.qwen3_8_flash_next_cp_all_gather(
            local["input_ids"], ctx, differentiable=False
        ),
        "batch_after": batch,
    }


def _qwen_ctx(env, seq_len: int, pad_multiple: int):
    batch = {"input_ids": torch.zeros(1, seq_len, dtype=torch.long)}
    _, local, _ = qwen.shard_batch_for_qwen3_8_flash_next_cp(
        env.group, None, batch, pad_multiple=pad_multiple
    )
    return local["cp_context"]


def qwen_gather(env, full: torch.Tensor):
    """Float gather with gradient, a compressed (1/4) stream, another sequence_dim, a bad shard."""
    ctx = _qwen_ctx(env, full.shape[1], 4)
    x = _slice(full, env).clone().requires_grad_()
    g = qwen.qwen3_8_flash_next_cp_all_gather(x, ctx)
    w = torch.arange(g.numel(), dtype=g.dtype).view_as(g)
    (g * w).sum().backward()
    compressed = x.detach().unflatten(1, (-1, 4)).sum(2)
    g_comp = qwen.qwen3_8_flash_next_cp_all_gather(compressed, ctx)
    g_dim2 = qwen.qwen3_8_flash_next_cp_all_gather(
        x.detach().transpose(1, 2), ctx, sequence_dim=2
    )
    try:
        qwen.qwen3_8_flash_next_cp_all_gather(x.detach()[:, :3], ctx)
        bad = None
    except ValueError as err:
        bad = str(err)
    return g.detach(), x.grad, g_comp, g_dim2, bad


def qwen_halo(env, full: torch.Tensor, history: int):
    ctx = _qwen_ctx(env, full.shape[1], 1)
    x = _slice(full, env).clone().requires_grad_()
    halo = qwen.qwen3_8_flash_next_cp_left_halo(x, ctx, history)
    halo.sum().backward()
    return halo, x.grad


def qwen_context_errors(env):
    """Contexts whose size / rank disagree with the real group are rejected on every rank."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.ones(1, 4, dtype=torch.bool)
    cases = {
        "size": dict(rank=0, size=1, local_sequence_start=0, local_sequence_length=4),
        "rank": dict(rank=1 - env.rank, size=2, local_sequence_start=2 * (1 - env.rank),
                     local_sequence_length=2),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            qwen.Qwen3_8_FlashNextCPContext(env.group, global_input_ids=ids,
                                            global_padding_mask=mask, **kwargs)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    ok = qwen.Qwen3_8_FlashNextCPContext(env.group, env.rank, 2, ids, mask, 2 * env.rank, 2)
    out["ok"] = (ok.packed_context.cp_size, ok.packed_context.cp_rank, ok.local_sequence_end)
    return out
