"""The elementwise (diagonal) linear recurrence ``h_t = a_t * h_{t-1} + x_t`` over packed
documents, exact under contiguous CP: every channel its own scalar state, restarted at every
document start (RecurrentGemma's RG-LRU, and any gated linear RNN with a diagonal transition).

* :mod:`.reference` - the definition (per-token float64 loop; tests only);
* :mod:`.tree` - the exact static-shape PyTorch path (``backend="tree"``, the default): a
  log-depth scan over the tokens (:func:`fcp.scan.decay_scan`), the CP state chain.

:func:`elementwise_scan` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.elementwise_scan.tree import elementwise_scan_tree
from fcp.ops.kit.common import autocast_off, choose_backend, finite_or_zero, zero_nonfinite_grad

__all__ = ["BACKENDS", "check_elementwise_scan_inputs", "elementwise_scan"]

#: ``"tree"``: exact PyTorch, every device (a log-depth scan over the tokens).
BACKENDS = ("tree",)


def check_elementwise_scan_inputs(x, a, local_len: int | None, batch: int | None) -> None:
    """Types and shapes of :func:`elementwise_scan`'s tensors (the :mod:`fcp.checks` rule,
    naming the tensor)."""
    fn = "elementwise_scan"
    for name, t in (("x", x), ("a", a)):
        check_tensor(t, name, fn=fn, kind="float")
    if x.dim() < 3:
        raise ValueError(f"{fn}: x must be [batch, seq, channels, ...] (3-D or more), got shape "
                         f"{tuple(x.shape)}")  # fmt: skip
    if a.shape != x.shape:
        raise ValueError(f"{fn}: a must have x's shape {tuple(x.shape)} (one decay per channel "
                         f"and token), got {tuple(a.shape)}")  # fmt: skip
    if local_len is not None and x.shape[1] != local_len:
        raise ValueError(f"{fn}: seq={x.shape[1]} != ctx.local_seq_len={local_len}")
    if batch is not None and x.shape[0] != batch:
        raise ValueError(f"{fn}: batch={x.shape[0]} != ctx.batch_size {batch}")


def elementwise_scan(x: torch.Tensor, a: torch.Tensor, ctx: PackedContext, *,
                     backend: str = "auto") -> torch.Tensor:
    """The diagonal linear recurrence on this rank's shard of a packed batch.

    Per channel ``c``, a scalar state restarted at zero at every document start::

        h_t = a_t * h_{t-1} + x_t          (h_t = x_t at a document's first token)

    Args:
        x: ``[batch, local_seq, *channels]`` (one or more channel dims: ``[B, L, C]``, or
            ``[B, L, H, P]`` with heads), the inputs added at each token.
        a: the same shape: the multiplicative decay applied to the state before each token's
            update (not a log decay: ``a = exp(log_a)`` for a log decay), usually in ``[0, 1]``;
            ``0`` forgets everything, ``1`` nothing. The value at a document's first token is
            not read (the state restarts there). ``|a| > 1`` is computed as written and may
            overflow.
        ctx: this rank's :class:`~fcp.context.PackedContext`; ``local_seq`` must be
            ``ctx.local_seq_len``. The state restarts at every run start of the global map
            (documents and the pad tail).
        backend: ``"auto"`` (= ``"tree"``) or ``"tree"``; see :data:`BACKENDS`.

    Returns:
        ``h`` ``[batch, local_seq, *channels]`` in ``x``'s dtype. The state and every product
        and sum are fp32 whatever the input dtype (fp64 for fp64 inputs; the CP state chain is
        fp32).

    Exact to fp32 rounding (the sums associate as a log-depth tree, not left to right), bitwise
    independent of the values of other documents, deterministic, sync-free and
    recompile-free across packings; non-finite values stay inside their document
    (:mod:`fcp.ops.kit.common`). Under CP, one :func:`~fcp.comm.state_chain` all-gather of fp32
    ``[batch, channels, 1, 2]`` per call (each channel's shard map ``h_out = m h_in + h_0``).

    RecurrentGemma's RG-LRU (transformers' ``RecurrentGemmaRglru``) maps onto it with its gates
    outside (``starts``: the document starts, its ``position_ids == 0``)::

        log_a = -8 * sigmoid(recurrence gate) * softplus(recurrent_param)         # [B, L, W]
        a = exp(log_a)
        u = x * sigmoid(input gate) * where(starts, 1, sqrt(1 - exp(2 log_a)))
        h = elementwise_scan(u, a, ctx)

    Example (one channel, ``a = 0.5``: ``h <- h / 2 + x``; documents of lengths 3 and 2, then
    one pad token)::

        >>> doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0]])
        >>> x = torch.tensor([4.0, 4, 4, 2, 2, 8]).view(1, 6, 1)
        >>> h = elementwise_scan(x, torch.full_like(x, 0.5), PackedContext(doc_ids))
        >>> h.flatten().tolist()
        [4.0, 6.0, 7.0, 2.0, 3.0, 8.0]
    """
    check_context(ctx, fn="elementwise_scan")
    check_elementwise_scan_inputs(x, a, ctx.local_seq_len, ctx.batch_size)
    choose_backend("elementwise_scan", backend, BACKENDS, "tree")
    x, a = finite_or_zero(x), finite_or_zero(a)
    with autocast_off(x.device):
        out = elementwise_scan_tree(x, a, ctx)
    return zero_nonfinite_grad(out)
