"""xLSTM's mLSTM stabiliser (the running max of its exponential gates) over packed documents,
exact under contiguous CP; with :func:`fcp.ops.gla.gla` it is the whole mLSTM.

* :mod:`.reference` - the definitions (the stabiliser and the whole mLSTM, per-token loops;
  tests only);
* :mod:`.scan` - the exact static-shape PyTorch path (``backend="scan"``): a log-depth max-plus
  scan.

:func:`mlstm_stabilizer` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import autocast_off, choose_backend, finite_or_zero, zero_nonfinite_grad
from fcp.ops.mlstm.scan import stabilizer_scan

__all__ = ["BACKENDS", "mlstm_stabilizer"]

#: ``"scan"``: exact PyTorch, every device.
BACKENDS = ("scan",)


def mlstm_stabilizer(log_f: torch.Tensor, log_i: torch.Tensor, ctx: PackedContext, *,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The mLSTM's running max on this rank's shard of a packed batch.

    Per head, inside each document, ``m_t = max(log_f_t + m_{t-1}, log_i_t)`` with ``m = 0``
    before the document's first token (transformers' zero initial max state).

    Args:
        log_f: ``[batch, local_seq, heads]``, the log forget gates (``logsigmoid`` of the forget
            preactivation, ``<= 0``).
        log_i: ``[batch, local_seq, heads]``, the log input gates (the input preactivation: an
            exponential gate).
        ctx: this rank's :class:`~fcp.context.PackedContext`; ``local_seq`` must be
            ``ctx.local_seq_len``.
        backend: ``"auto"`` (= ``"scan"``) or ``"scan"``.

    Returns:
        ``(m, m_prev)``, ``[batch, local_seq, heads]`` each in fp32 (fp64 for fp64 inputs): the
        running max after each token and before it (0 at a document start), differentiable
        (through the maximum, as the loop).

    The mLSTM itself is gated linear attention (:func:`fcp.ops.gla.gla`) once the state is
    scaled by ``e^{-m_t}``: with ``r = m.detach()`` (a reference that cancels, so its gradient
    may be dropped) and ``s = K ** -0.5``::

        y = gla(q, k * exp(log_i - r), [v | 1], log_f + r_prev - r, ctx, scale=s)  # exps <= 0
        h = y[..., :V] / (max(|y[..., V]|, exp(-r)) + eps * exp(m - r))

    is transformers' ``h = (s q)^T C_t / (max(|(s q)^T n_t|, e^{-m_t}) + eps)`` exactly: the
    ``eps`` term is the only place where ``m`` (not a reference) enters the value, and it keeps
    its gradient. Under CP: one differentiable all-gather of fp32 ``[batch, heads, 2]`` (the
    shards' max-plus maps), besides the GLA's state chain.

    Example (one head, no forgetting: the running max of the input gates and of 0)::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 1, 2, 2]]))
        >>> m, m_prev = mlstm_stabilizer(torch.zeros(1, 5, 1),
        ...                              torch.tensor([-1.0, 2, 1, 3, -2]).view(1, 5, 1), ctx)
        >>> m.flatten().tolist(), m_prev.flatten().tolist()
        ([0.0, 2.0, 2.0, 3.0, 3.0], [0.0, 0.0, 2.0, 0.0, 3.0])
    """
    fn = "mlstm_stabilizer"
    check_context(ctx, fn=fn)
    shape = (ctx.batch_size, ctx.local_seq_len, None)
    layout = "[batch, local_seq, heads]"
    check_tensor(log_f, "log_f", fn=fn, kind="float", shape=shape, layout=layout)
    check_tensor(log_i, "log_i", fn=fn, kind="float", shape=tuple(log_f.shape), layout=layout)
    choose_backend(fn, backend, BACKENDS, "scan")
    log_f, log_i = finite_or_zero(log_f), finite_or_zero(log_i)
    with autocast_off(log_f.device):
        m, m_prev = stabilizer_scan(log_f, log_i, ctx)
    return zero_nonfinite_grad(m), zero_nonfinite_grad(m_prev)
