"""Functions run on pool ranks by the sharding tests (importable by module path)."""

from __future__ import annotations

import time

import torch

from fcp.shard import gather_sequence, shard_batch


def shard_and_gather(env, batch: dict, pad_multiple: int, use_mesh: bool):
    """Shard ``batch`` on this rank, then gather every token stream back to the full row."""
    group = env.mesh() if use_mesh else env.group
    local, ctx = shard_batch(group, batch, pad_multiple=pad_multiple)
    gathered = {}
    for key, value in local.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            gathered[key] = gather_sequence(value, ctx, unpad=True)
            gathered[key + "@padded"] = gather_sequence(value, ctx, unpad=False)
    return {
        "local": local,
        "gathered": gathered,
        "doc_ids": ctx.doc_ids,
        "local_doc_ids": ctx.local_doc_ids,
        "interval": ctx.interval,
        "cp": (ctx.cp_size, ctx.cp_rank, ctx.local_seq_len, ctx.original_seq_len),
        "input_unchanged": batch,
    }


def shard_error(env, batch: dict, kwargs: dict):
    """Return the error every rank raises for a bad batch (or None)."""
    try:
        shard_batch(env.group, batch, **kwargs)
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err)
    return None


def gather_grad(env, full: torch.Tensor):
    """Gradients of the unpadded gather flow back to the rank that owns each token."""
    batch = {"inputs_embeds": full}
    local, ctx = shard_batch(env.group, batch)
    x = local["inputs_embeds"].clone().requires_grad_()
    out = gather_sequence(x, ctx)
    weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return x.grad, ctx.interval


def primary_kept_full(env, batch: dict):
    local, ctx = shard_batch(env.group, batch, shard_primary=False)
    embeds = torch.nn.functional.one_hot(local["input_ids"], 8).float().requires_grad_()
    sliced = ctx.shard(embeds)
    sliced.sum().backward()
    return local["input_ids"].shape, local["shift_labels"], sliced.detach(), embeds.grad


def shard_with(sharder: str, group, batch: dict, kwargs: dict):
    """``("ok", padded length)`` or the error's ``(type name, message)`` of one sharder:
    ``"fcp"`` (:func:`fcp.shard_batch`), ``"glm"`` or ``"qwen"`` (the seed sharders)."""
    from fcp.models.glm5_next.cp import shard_batch_for_glm5_next_cp
    from fcp.models.qwen3_8_flash_next.cp import shard_batch_for_qwen3_8_flash_next_cp

    try:
        if sharder == "fcp":
            return "ok", shard_batch(group, batch, **kwargs)[1].global_seq_len
        fn = {"glm": shard_batch_for_glm5_next_cp,
              "qwen": shard_batch_for_qwen3_8_flash_next_cp}[sharder]  # fmt: skip
        return "ok", fn(group, None, dict(batch), **kwargs)[2].padded_seq_len
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err)


def shard_own_batch(env, batches: list, sharder: str, kwargs: dict):
    """:func:`shard_with` on ``batches[rank]`` (ranks that disagree)."""
    return shard_with(sharder, env.group, batches[env.rank], kwargs)


def local_labels(env, batch: dict, sharder: str):
    """This rank's next-token targets and loss mask after sharding ``batch`` with ``sharder``
    (fcp's ``shift_labels``, NeMo's ``labels``)."""
    from fcp.models.glm5_next.cp import shard_batch_for_glm5_next_cp

    if sharder == "fcp":
        local, _ = shard_batch(env.group, batch)
        return local["shift_labels"], local["loss_mask"]
    _, local, _ = shard_batch_for_glm5_next_cp(env.group, None, dict(batch),
                                               loss_mask=batch["loss_mask"])  # fmt: skip
    return local["labels"], local["loss_mask"]


def shard_variants(env, batches: list, pad_multiple: int = 1):
    """``(local batch, global doc map, local doc map)`` of each of ``batches`` on this rank."""
    out = []
    for batch in batches:
        local, ctx = shard_batch(env.group, batch, pad_multiple=pad_multiple)
        out.append((local, ctx.doc_ids, ctx.local_doc_ids))
    return out


def mixed_group_kinds(env, with_group: list, join_timeout: float):
    """Ranks in ``with_group`` pass the CP group, the others ``None``: seconds until this rank's
    ``shard_batch`` returned, or its ``RuntimeError`` with the seconds appended (re-raised, so
    that the pool rebuilds the groups: the store's rounds are out of step afterwards)."""
    group = env.group if env.rank in with_group else None
    t0 = time.perf_counter()
    try:
        shard_batch(group, {"input_ids": torch.ones(1, 8, dtype=torch.long)},
                    join_timeout=join_timeout)  # fmt: skip
    except RuntimeError as err:
        raise RuntimeError(f"{err} [after {time.perf_counter() - t0:.3f} s]") from None
    return time.perf_counter() - t0
