"""Token lags: every token's ``size - 1`` predecessors inside its document, exact under CP.

The input of token-mixing pieces that read a few earlier tokens with weights of their own (not
a depthwise conv, which :func:`fcp.ops.conv.short_conv` computes): a grouped conv over heads
(ZAYA's CCA), a token shift (ZAYA's delayed value half), a conv whose taps are per-token weights
(Inkling-2's dynamic short conv). Entry ``j`` of a token is the token ``j`` positions before it,
or a ``fill`` value where that token lies before the document's start (another document, the
row's start, or padding): what each document computed alone with ``fill`` as its left padding
reads.

* :mod:`.reference` - the definition (a Python loop per token; tests only);
* :mod:`.halo` - the ``"halo"`` backend: the ``size - 1`` tokens before this rank's interval by
  one :func:`~fcp.comm.with_left_halo`, documents from the replicated map; every device, static
  shapes.

:func:`token_lags` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_float, check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import choose_backend
from fcp.ops.token_lags.halo import token_lags_halo

__all__ = ["BACKENDS", "token_lags"]

#: ``"halo"``: one left halo of ``size - 1`` tokens per call (exact, every device).
BACKENDS = ("halo",)


def token_lags(x: torch.Tensor, ctx: PackedContext, size: int, *,
               fill: float | torch.Tensor = 0.0,
               backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """The ``size`` most recent tokens of every token's document, newest first.

    Args:
        x: ``[batch, local_seq, channels]``, this rank's shard (any float dtype).
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        size: entries per token, the token itself included; ``size - 1`` may exceed
            ``local_seq`` (the lags then reach several earlier ranks).
        fill: what an entry holds where its token is not in the document: a float, or a
            ``[channels]`` tensor (e.g. a conv's output over zero padding; gradients flow to
            it).
        backend: ``"auto"`` (= ``"halo"``) or ``"halo"``.

    Returns:
        ``[batch, local_seq, size, channels]`` in ``x``'s dtype (``fill`` cast to it): entry
        ``j`` is ``x`` at the token ``j`` positions back when it is in the same real document,
        else ``fill``; entry 0 is ``x`` itself (for pad tokens too; their other entries are
        ``fill``). Gradients flow to the ranks owning the lagged tokens.

    Under CP: one all-to-all of ``size - 1`` tokens per row (:func:`~fcp.comm.with_left_halo`),
    no host synchronisation, static shapes.

    Example (``size=2``): documents ``[1, 2]`` and ``[3]``; the third token starts a document::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 2]]))
        >>> token_lags(torch.tensor([[[1.0], [2.0], [3.0]]]), ctx, 2, fill=-1.0)[0, :, :, 0]
        tensor([[ 1., -1.],
                [ 2.,  1.],
                [ 3., -1.]])
    """
    name = "token_lags"
    check_context(ctx, fn=name, name="ctx")
    check_tensor(x, "x", fn=name, kind="float", shape=(ctx.batch_size, ctx.local_seq_len, None),
                 layout="[batch, local_seq, channels]")  # fmt: skip
    size = check_positive_int(size, "size", fn=name)
    if isinstance(fill, torch.Tensor):
        check_tensor(fill, "fill", fn=name, kind="float", shape=(x.shape[-1],),
                     layout="[channels]")  # fmt: skip
        fill = fill.to(x.dtype)
    else:
        fill = check_float(fill, "fill", fn=name)
    choose_backend(name, backend, BACKENDS, "halo")
    return token_lags_halo(x, ctx, size, fill)
