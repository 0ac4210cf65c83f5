"""Loss normalisation across data and context parallelism: the global token mean, exactly.

With CP, a rank holds a contiguous slice of some rows; with data parallelism, other ranks hold
other rows. Training equals single-process training on the whole global batch only if every
rank divides its *sum* of token losses by the number of loss tokens of the **global** batch (not
its own count: ranks hold different numbers of loss tokens, a rank may hold only padding) and the
gradient reduction then *sums* the ranks' gradients. A reduction that averages (FSDP2's and DDP's
default, which divides by the group size) is compensated by multiplying by what it divides by::

    # every rank, every step (group: the flattened data x context mesh, or None)
    loss = global_token_mean(loss_sum, n_loss_tokens, group, gradient_divide_factor=world)
    loss.objective.backward()     # then FSDP2 / DDP average the gradients over `world` ranks
    loss.value                    # the global mean, identical on every rank, for logging

``n_loss_tokens`` counts this rank's next-token targets: with :func:`fcp.shard_batch`, the
``shift_labels`` of its local batch (``fcp.loss.loss_token_count(local["shift_labels"])``).

One all-reduce of two fp32 scalars per step (funcol: compiles, no host synchronisation).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol

from fcp.checks import check_positive_int, check_tensor
from fcp.groups import GroupLike, resolve_group

__all__ = ["GlobalMean", "global_token_mean", "loss_token_count"]


class GlobalMean(NamedTuple):
    """``objective``: this rank's term to differentiate (``objective.backward()``); ``value``: the
    global mean loss (detached, the same on every rank); ``tokens``: the global number of loss
    tokens (fp32)."""

    objective: torch.Tensor
    value: torch.Tensor
    tokens: torch.Tensor

    def reported(self) -> torch.Tensor:
        """One tensor for both jobs: its value is :attr:`value` (what one process would report)
        and its gradient is :attr:`objective`'s (what the gradient reduction needs)."""
        return self.objective + (self.value - self.objective).detach()


def loss_token_count(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """int64 scalar: the tokens of ``labels`` (any shape) that carry a loss.

    On the ``shift_labels`` of :func:`fcp.shard_batch` (the next-token targets) that is the real
    targets only: every token outside a document (doc id 0: the batch's pad tail and the CP
    padding) and every document's last token has target ``ignore_index``.

    >>> loss_token_count(torch.tensor([[5, 6, -100, -100]]))
    tensor(2)
    """
    return (labels != ignore_index).sum()


def global_token_mean(
    loss_sum: torch.Tensor,
    loss_tokens: torch.Tensor | int,
    group: GroupLike = None,
    *,
    gradient_divide_factor: int = 1,
) -> GlobalMean:
    """This rank's share of the global token-mean loss.

    Args:
        loss_sum: scalar, the sum of this rank's per-token losses (differentiable).
        loss_tokens: this rank's number of loss tokens (int or integer scalar tensor; 0 is fine).
        group: every rank holding part of the global batch, a :data:`~fcp.groups.GroupLike`
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` such as a flattened ``("dp", "cp")`` mesh,
            a ``GroupInfo``, or ``None``: one process). A raw group, not a context: the loss
            spans the data-parallel ranks too.
        gradient_divide_factor: what the gradient reduction divides by: the group size for
            FSDP2's / DDP's default averaging, 1 for a summing reduction.

    Returns:
        :class:`GlobalMean`: ``objective = loss_sum / N * gradient_divide_factor`` with ``N`` the
        global number of loss tokens (at least 1, so an all-padding batch gives 0, not NaN).
        After the gradient reduction every rank's gradient is the gradient of the global mean.
    """
    name = "global_token_mean"
    info = resolve_group(group, fn=name)
    gradient_divide_factor = check_positive_int(gradient_divide_factor, "gradient_divide_factor",
                                                fn=name)  # fmt: skip
    check_tensor(loss_sum, "loss_sum", fn=name, kind="float", dim=0, layout="a scalar")
    count = torch.as_tensor(loss_tokens, device=loss_sum.device).to(torch.float32).reshape(())
    totals = torch.stack([loss_sum.detach().float(), count])
    if info.group is not None:
        totals = funcol.all_reduce(totals, "sum", info.group)
        if isinstance(totals, funcol.AsyncCollectiveTensor):
            totals = totals.wait()
    n = totals[1].clamp(min=1.0)
    objective = loss_sum * (gradient_divide_factor / n).to(loss_sum.dtype)
    return GlobalMean(objective, (totals[0] / n).to(loss_sum.dtype), totals[1])
