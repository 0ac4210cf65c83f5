"""Token history: each token's preceding token ids inside its document, exact under CP.

The input of hashed n-gram embeddings (Qwen4-Exp's PLE layers): column ``s`` of a token's row is
the id ``s`` positions before it, or a fill id where that token lies before the document start
(or before a reset token, e.g. end-of-sequence, inside the document). Integer ids only: no
gradient.

* :mod:`.reference` - the definition (a Python loop per token; tests only);
* :mod:`.halo` - the ``"halo"`` backend: the ``size - 1`` ids before this rank's interval by one
  :func:`~fcp.comm.left_halo`, documents from the replicated map; every device, static shapes.

:func:`token_history` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_int, check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import choose_backend
from fcp.ops.token_history.halo import token_history_halo

__all__ = ["BACKENDS", "token_history"]

#: ``"halo"``: one integer left halo of ``size - 1`` ids per call (exact, every device).
BACKENDS = ("halo",)
_RUN = {"halo": token_history_halo}


def token_history(tokens: torch.Tensor, ctx: PackedContext, size: int, *, fill: int,
                  reset: int | None = None, backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """The ``size`` most recent token ids of every token's document, newest first.

    Args:
        tokens: int ``[batch, local_seq]``, this rank's token ids (any integer dtype).
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        size: ids per token, the token itself included (an n-gram model's ``n``); ``size - 1``
            may exceed ``local_seq`` (the history then spans several earlier ranks).
        fill: the id written where the history runs out: before the document starts, after a
            ``reset`` token, and on pad tokens (except their column 0).
        reset: ``None``, or a token id after which the history restarts inside a document
            (transformers' PLE restarts it after every end-of-sequence token). The reset token
            itself still appears in the rows of the tokens after it; the tokens before it do not.
        backend: ``"auto"`` (= ``"halo"``) or ``"halo"``.

    Returns:
        int64 ``[batch, local_seq, size]``: column 0 is the token itself, column ``s`` the token
        ``s`` positions before it when that token is in the same document and no ``reset`` token
        lies strictly between them, else ``fill``.

    Under CP: one all-to-all of ``size - 1`` ids per row (:func:`~fcp.comm.left_halo`), no host
    synchronisation, static shapes (a compiled model does not recompile for a new packing).

    Example (``size=3``, end-of-sequence id 2; documents ``[5, 6, 2, 7]`` and ``[8]``): token 7
    follows an end-of-sequence token, so only that one is kept; token 8 starts a document::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 1, 1, 2]]))
        >>> token_history(torch.tensor([[5, 6, 2, 7, 8]]), ctx, 3, fill=2, reset=2)[0].tolist()
        [[5, 2, 2], [6, 5, 2], [2, 6, 5], [7, 2, 2], [8, 2, 2]]
    """
    name = "token_history"
    check_context(ctx, fn=name, name="ctx")
    check_tensor(tokens, "tokens", fn=name, kind="int", shape=(ctx.batch_size, ctx.local_seq_len),
                 layout="[batch, local_seq]")  # fmt: skip
    size = check_positive_int(size, "size", fn=name)
    fill = check_int(fill, "fill", fn=name)
    if reset is not None:
        reset = check_int(reset, "reset", fn=name)
    backend = choose_backend(name, backend, BACKENDS, "halo")
    return _RUN[backend](tokens, ctx, size, fill, reset)
