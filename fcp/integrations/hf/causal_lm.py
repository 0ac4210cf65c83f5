"""The next-token loss of an enabled transformers model under a ``cp_context``: right or refused.

transformers' causal-LM heads take **unshifted** ``labels`` and shift them inside the forward
(the target of token ``t`` is ``labels[t + 1]``). Under CP each rank holds one contiguous shard,
so shifting there loses the target of the shard's last token (it sits on the next rank), and the
head's mean over the shard weights the ranks wrong. :func:`fcp.shard_batch` therefore builds the
next-token targets over the whole row before sharding (``shift_labels``: the next token of the
same document, -100 at each document's last token and on padding), and this hook computes the
loss from them. Under a ``cp_context``:

* ``shift_labels=`` (with or without ``labels=``): the loss is the cross-entropy of the local
  logits against them (fp32), normalised by ``num_items_in_batch`` when given (transformers'
  contract, the Trainer's: this rank's token-loss sum over the global number of loss tokens;
  the caller sums the ranks, the Trainer by ``loss * world`` before DDP / FSDP average), else
  by the number of loss tokens of the whole CP group (one all-reduce of two fp32 scalars). In
  the second case ``.loss`` has the value one process computes on the batch, on every CP rank,
  and the gradient that an averaging reduction over the CP ranks (DDP's, FSDP2's) turns into
  the one-process gradient (:meth:`fcp.loss.GlobalMean.reported`). With data parallelism pass
  ``num_items_in_batch`` (the loss tokens of all data-parallel ranks), as the Trainer does.
* ``labels=`` alone raises a ``ValueError`` saying to pass ``shift_labels`` (shifting inside a
  shard would be silently wrong).
* TRL's fused LM head (``fused_lm_head=True``) scores ``shift_labels`` itself, normalised by
  ``num_items_in_batch``: the hook leaves it alone (``labels=`` alone still raises).
* A router auxiliary loss (``output_router_logits``) raises: its load statistics would be the
  shard's, not the batch's.

Example (one process; documents ``[5, 6, 7]`` and ``[8, 9]``)::

    local, ctx = fcp.shard_batch(None, {"input_ids": ids, "labels": ids, "seq_lens": [[3, 2]]})
    local["shift_labels"]          # [[6, 7, -100, 9, -100]]
    out = model(**local, cp_context=ctx)
    out.loss                       # mean over the 3 targets, as transformers on each document
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fcp.integrations.hf.core import positional_parameters
from fcp.loss import global_token_mean, loss_token_count
from fcp.shard import IGNORE_INDEX

__all__ = ["CausalLMLoss"]


class CausalLMLoss:
    """The pre- and post-forward hooks that compute an enabled model's loss under a context.

    :meth:`register` installs them once per model; :meth:`enter` takes the loss arguments out of
    the call (the model itself computes no loss under a context) and :meth:`exit` adds ``loss``
    to the model's output. State between the two lives in ``pending``, keyed by the call's own
    keyword dict, so nested and failing calls leave nothing behind.
    """

    def __init__(self, positional: tuple[str, ...]) -> None:
        self.positional = positional
        self.pending: dict[int, tuple] = {}

    @staticmethod
    def register(model: nn.Module) -> None:
        """Install the hooks on ``model`` unless it has them (idempotent)."""
        for hook in model._forward_pre_hooks.values():
            if isinstance(getattr(hook, "__self__", None), CausalLMLoss):
                return
        hooks = CausalLMLoss(positional_parameters(model))
        model.register_forward_pre_hook(hooks.enter, with_kwargs=True)
        model.register_forward_hook(hooks.exit, with_kwargs=True, always_call=True)

    def enter(self, model: nn.Module, args: tuple, kwargs: dict):
        ctx = kwargs.get("cp_context")
        if ctx is None:
            return None
        fn = f"{type(model).__name__}.forward"
        named = dict(zip(self.positional, args))
        labels = kwargs.get("labels", named.get("labels"))
        shift = kwargs.get("shift_labels")
        if labels is not None and shift is None:
            raise ValueError(
                f"{fn}: labels= with cp_context would be shifted inside this rank's shard (the "
                "target of its last token lives on the next rank, and the mean weights the ranks "
                "wrong); pass shift_labels= from fcp.shard_batch instead (model(**local, "
                "cp_context=ctx) does), or compute the loss from the logits yourself"
            )
        if kwargs.get("fused_lm_head"):
            return None  # TRL's fused head scores shift_labels itself (see the module doc)
        if shift is None:
            return None
        if "labels" in named:
            raise TypeError(f"{fn}: with cp_context, pass labels by keyword")
        if kwargs.get("return_dict") is False:
            raise ValueError(f"{fn}: shift_labels with cp_context needs return_dict=True")
        config = getattr(model, "config", None)
        if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
            raise ValueError(
                f"{fn}: a router auxiliary loss (output_router_logits=True) under cp_context "
                "would use this shard's load statistics, not the batch's; pass "
                "output_router_logits=False"
            )
        items = kwargs.get("num_items_in_batch")
        kwargs = {k: v for k, v in kwargs.items()
                  if k not in ("labels", "shift_labels", "num_items_in_batch")}  # fmt: skip
        # keyed by the dict the forward hook will be handed: this call's own keywords
        self.pending[id(kwargs)] = (shift, items, ctx)
        return args, kwargs

    def exit(self, model: nn.Module, args: tuple, kwargs: dict, output):
        entry = self.pending.pop(id(kwargs), None)
        if entry is None or output is None:  # no loss asked for, or the forward raised
            return None
        shift, items, ctx = entry
        fn = f"{type(model).__name__}.forward"
        logits = getattr(output, "logits", None)
        if logits is None:
            raise ValueError(f"{fn}: shift_labels with cp_context need a model with logits "
                             f"(a *ForCausalLM), got {type(output).__name__}")  # fmt: skip
        shift = shift.to(logits.device)
        if tuple(logits.shape[:-1]) != tuple(shift.shape):
            raise ValueError(
                f"{fn}: shift_labels has shape {tuple(shift.shape)} but the logits are "
                f"{tuple(logits.shape)} (logits_to_keep must be 0 with shift_labels)"
            )
        # at least fp32, as transformers' heads (fp64 models stay fp64)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss_sum = F.cross_entropy(logits.flatten(0, -2), shift.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
        if items is not None:
            loss = loss_sum / torch.as_tensor(items, dtype=torch.float32, device=loss_sum.device)
        else:
            mean = global_token_mean(loss_sum, loss_token_count(shift), ctx.group,
                                     gradient_divide_factor=ctx.cp_size)  # fmt: skip
            loss = mean.reported()
        fields = {k: v for k, v in output.items() if k != "loss"}
        return type(output)(loss=loss, **fields)

