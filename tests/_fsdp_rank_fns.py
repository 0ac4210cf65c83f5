"""Rank functions of the data x context parallel training tests (FSDP2 on a 2-D gloo mesh)."""

from __future__ import annotations

import copy

import torch

import fcp
from fcp.loss import global_token_mean, loss_token_count

#: Adam divides each gradient entry by its own magnitude: with the default eps (1e-8) an entry
#: whose gradient is ~1e-8 (a tiny model's hyper-connection mixes have some) turns float32
#: rounding of that gradient into an O(lr) difference of its update. eps = 1e-6 bounds that
#: amplification, so the comparison measures the parallel gradients, not Adam's conditioning.
ADAM_EPS = 1e-6



def dp_cp_mesh(dp: int, cp: int):
    """A ``("dp", "cp")`` CPU mesh over the default group's ranks and its flattened 1-D view."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


def shard_model(model: torch.nn.Module, flat_mesh) -> torch.nn.Module:
    """FSDP2 over the flattened data x context mesh: every block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=flat_mesh)
    fully_shard(model, mesh=flat_mesh)
    return model


def dp_rows(batch: dict, dp: int, dp_rank: int) -> dict:
    """This data-parallel replica's rows of the global batch (rows are dealt round-robin)."""
    return {k: v[dp_rank::dp] for k, v in batch.items()}


def fsdp_train(env, model_fn, batches, dp: int, cp: int, lr: float, checkpoint=None):
    """AdamW steps of ``model_fn()`` with FSDP2 over dp x cp; returns the global losses and the
    full final parameters. ``checkpoint=(dir, k)``: save after step k, rebuild everything from
    scratch, load, and continue (the losses must not notice)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions

    mesh, flat = dp_cp_mesh(dp, cp)
    torch.manual_seed(0)
    model = shard_model(model_fn(), flat)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)
    losses = []
    for step, batch in enumerate(batches):
        rows = dp_rows(batch, dp, mesh["dp"].get_local_rank())
        local, ctx = fcp.shard_batch(mesh["cp"], rows, pad_multiple=model.pad_multiple)
        logits = model(local["input_ids"], ctx)
        loss_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), local["shift_labels"].flatten(), reduction="sum"
        )
        loss = global_token_mean(loss_sum, loss_token_count(local["shift_labels"]), flat,
                                 gradient_divide_factor=flat.size())  # fmt: skip
        loss.objective.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.value))
        if checkpoint is not None and step == checkpoint[1]:
            model, opt = _save_and_reload(model, opt, model_fn, flat, checkpoint[0], lr)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return losses, {k: v.detach().clone() for k, v in full.items()}


def _save_and_reload(model, opt, model_fn, flat, path, lr):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = shard_model(model_fn(), flat)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def single_process_train(model_fn, batches, lr: float):
    """The same steps in one process on the whole global batch: the reference."""
    torch.manual_seed(0)
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)
    losses = []
    for batch in batches:
        local, ctx = fcp.shard_batch(None, batch, pad_multiple=model.pad_multiple)
        logits = model(local["input_ids"], ctx)
        loss_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), local["shift_labels"].flatten(), reduction="sum"
        )
        loss = loss_sum / loss_token_count(local["shift_labels"]).clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in copy.deepcopy(model).state_dict().items()}


def global_mean_on_ranks(env):
    """Ranks hold 1, 2, 4 loss tokens with loss sums 0, 2, 4 (a 3-rank averaging reduction)."""
    tokens = [1, 2, 4][env.rank]
    loss_sum = torch.tensor(float(2 * env.rank), requires_grad=True)
    out = global_token_mean(loss_sum, tokens, env.group, gradient_divide_factor=3)
    out.objective.backward()
    return float(out.value), float(out.tokens), float(loss_sum.grad)
