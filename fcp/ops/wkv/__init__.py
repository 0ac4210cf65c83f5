"""RWKV-4's WKV over packed documents, exact under contiguous CP.

* :mod:`.reference` - the definition (the per-token loop with transformers' running-max
  stabiliser; tests only);
* :mod:`.scan` - the exact static-shape PyTorch path (``backend="scan"``, the default): a
  log-depth scan of stabilised decayed sums.

:func:`wkv` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import autocast_off, choose_backend, finite_or_zero, zero_nonfinite_grad
from fcp.ops.wkv.scan import wkv_scan

__all__ = ["BACKENDS", "wkv"]

#: ``"scan"``: exact PyTorch, every device.
BACKENDS = ("scan",)


def wkv(k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, u: torch.Tensor, ctx: PackedContext,
        *, backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """RWKV-4's WKV on this rank's shard of a packed batch.

    Per channel, inside each document (both sums restart at every document start)::

        wkv_t = (sum_{i<t} e^{(t-1-i) a + k_i} v_i + e^{u + k_t} v_t)
              / (sum_{i<t} e^{(t-1-i) a + k_i}     + e^{u + k_t})

    Args:
        k, v: ``[batch, local_seq, channels]`` (RWKV's key and value projections).
        a: ``[channels]``, the per-step natural-log decay, expected ``<= 0`` (RWKV-4:
            ``a = -exp(time_decay)``); tested from 0 to -40 per token.
        u: ``[channels]``, the bonus of the current token (RWKV-4's ``time_first``).
        ctx: this rank's :class:`~fcp.context.PackedContext`; ``local_seq`` must be
            ``ctx.local_seq_len``. The sums restart at every run start of the global map
            (documents and the pad tail).
        backend: ``"auto"`` (= ``"scan"``) or ``"scan"``.

    Returns:
        ``[batch, local_seq, channels]`` in ``v``'s dtype; computed in fp32 (fp64 for fp64
        inputs), every exponent formed ``<= 0`` (a running maximum as the reference, so no key
        overflows), the CP state chain in fp32.

    Exact to fp32 rounding, bitwise document-independent, deterministic, sync-free and
    recompile-free across packings; non-finite values stay inside their document. Under CP, one
    all-gather of fp32 ``[batch, channels]`` (the running maxima at the shard ends, no gradient)
    and one :func:`~fcp.comm.state_chain` all-gather of fp32 ``[batch, channels, 1, 3]`` per
    call (:mod:`.scan` says why that is exact).

    RWKV-4 (transformers' ``RwkvSelfAttention``) maps onto it as
    ``wkv(key, value, -exp(time_decay), time_first, ctx)``.

    Example (one channel, ``a = u = 0``, unit keys: a running mean of the values within each
    document; documents of 3 and 2 tokens)::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 1, 2, 2]]))
        >>> v = torch.tensor([2.0, 4, 6, 1, 3]).view(1, 5, 1)
        >>> zero = torch.zeros(1)
        >>> wkv(torch.zeros(1, 5, 1), v, zero, zero, ctx).flatten().tolist()
        [2.0, 3.0, 4.0, 1.0, 2.0]
    """
    fn = "wkv"
    check_context(ctx, fn=fn)
    shape = (ctx.batch_size, ctx.local_seq_len, None)
    check_tensor(k, "k", fn=fn, kind="float", shape=shape, layout="[batch, local_seq, channels]")
    channels = k.shape[-1]
    check_tensor(v, "v", fn=fn, kind="float", shape=tuple(k.shape),
                 layout="[batch, local_seq, channels]")  # fmt: skip
    for name, t in (("a", a), ("u", u)):
        check_tensor(t, name, fn=fn, kind="float", shape=(channels,), layout="[channels]")
    choose_backend(fn, backend, BACKENDS, "scan")
    k, v, a, u = (finite_or_zero(t) for t in (k, v, a, u))
    with autocast_off(k.device):
        out = wkv_scan(k, v, a, u, ctx)
    return zero_nonfinite_grad(out)
