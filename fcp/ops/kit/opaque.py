"""Opaque in-chunk forms: the backward kernel of a custom op that hides a chunk form from Dynamo.

A chunked recurrence's *intra-chunk form* (KDA's WY hierarchy, :func:`fcp.ops.kit.recurrence.
wy_forms`; GLA's per-key pair scores) is hundreds of small ops over ``[.., C, C]`` and
``[.., C, K]`` blocks whose shapes are Python control flow on the chunk size. Traced by
``torch.compile`` with a dynamic sequence length, Dynamo and AOT autograd reason symbolically
about every one of them (forward and joint backward), and the reshapes of the block hierarchy
guard on the chunk count (a dynamic graph specialised on ``ceil(local_len / C)``: a third
compile when a row's chunk count changed). The operators therefore run their chunk form inside
a ``torch.library`` custom op: one graph node whose fake kernel states the output shapes as
expressions of the sizes, so Dynamo neither traces nor guards inside it.

The backward is a second custom op that *recomputes* the chunk form with autograd and pulls
the output gradients back (:func:`recompute_vjp`). The form is cheap next to the scan and the
outputs it feeds (``O(C^2 K)`` per chunk), the forward saves only its inputs (no ``[.., C, C]``
intermediates), and the gradients are autograd's own formulas on the same eager ops, so they
equal an eager run's bitwise.

A custom op's kernel runs below the autograd dispatch keys (``torch.library`` excludes them
while it redispatches), where ``enable_grad`` records nothing: :func:`autograd_in_kernel` lifts
that exclusion for the recomputation, and sets the caller's saved-tensor hooks aside (an
offloading hook must not see the kernel's transient tensors). Plain autograd, not
``torch.func.vjp``: functorch's wrappers fail under a user's ``TorchDispatchMode`` (a FLOP or
byte counter) and refuse saved-tensor hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["autograd_in_kernel", "recompute_vjp"]

_C = torch._C


def _autograd_keys() -> "torch._C.DispatchKeySet":
    # what torch.library's redispatch below autograd adds to the thread's excluded keys
    with _C._AutoDispatchBelowAutograd():
        below = _C._dispatch_tls_local_exclude_set()
    return below - _C._dispatch_tls_local_exclude_set()


_AUTOGRAD_KEYS = _autograd_keys()


@contextlib.contextmanager
def autograd_in_kernel() -> Iterator[None]:
    """Inside a custom op's kernel: autograd records again (grad mode on, autograd's dispatch
    keys no longer excluded) and the thread's saved-tensor default hooks are popped, until the
    block ends (then everything is as it was, hooks pushed back in their order)."""
    include, exclude = _C._dispatch_tls_local_include_set(), _C._dispatch_tls_local_exclude_set()
    hooks = []
    while (top := _C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        hooks.append(top)
        _C._autograd._pop_saved_tensors_default_hooks()
    try:
        with _C._ForceDispatchKeyGuard(include, exclude - _AUTOGRAD_KEYS), torch.enable_grad():
            yield
    finally:
        for pack, unpack in reversed(hooks):
            _C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def recompute_vjp(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor],
                  consts: Sequence[object],
                  grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """Gradients of ``fn(*inputs, *consts)`` with respect to ``inputs``, by recomputing it (in
    a custom op's kernel: :func:`autograd_in_kernel`).

    Args:
        fn: a function of tensors returning a tuple of tensors.
        inputs: the differentiable tensors, in ``fn``'s argument order.
        consts: the remaining arguments (index tensors, flags), not differentiated.
        grads: one gradient per output of ``fn``, ``None`` for an output that got none (read as
            zeros).

    Returns:
        One contiguous gradient per input, shaped and typed like it (zeros where ``fn`` does
        not use it); never an alias of an argument (a custom op's outputs may not alias its
        inputs).
    """
    with autograd_in_kernel():
        xs = [x.detach().requires_grad_() for x in inputs]
        outs = fn(*xs, *consts)
        cotangents = [torch.zeros_like(o) if g is None else g.to(o.dtype)
                      for o, g in zip(outs, grads)]  # fmt: skip
        pulled = torch.autograd.grad(outs, xs, cotangents, allow_unused=True,
                                     materialize_grads=True)  # fmt: skip
    args = {t.data_ptr() for t in (*inputs, *(g for g in grads if g is not None))}
    out = []
    for d in pulled:
        d = d.contiguous()
        out.append(d.clone() if d.data_ptr() in args else d)
    return tuple(out)
