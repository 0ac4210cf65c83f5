"""Rules every fcp operator shares: backend names, default scale, compute dtype, finiteness.

* :func:`choose_backend` - one way to pick a backend: an explicit ``backend=`` string per call,
  ``"auto"`` resolved from static facts (device) only, so Dynamo folds the choice at trace time.
* :func:`default_scale` - ``D ** -0.5`` unless given; :func:`scalar_tensor` - how a scale
  reaches a custom op's kernel (a 0-d tensor, not a ``float`` argument).
* :func:`compute_dtype` - fp32 for fp32/bf16/fp16 inputs, fp64 when any input is fp64: state
  chains and reductions accumulate in fp32 whatever the input dtype.
* :func:`autocast_off` and :func:`register_fp32_autocast` - every dispatcher runs its backend
  with autocast off, and every custom op has autocast's fp32 rule (see below).
* :func:`finite_or_zero` and :func:`zero_nonfinite_grad` - how operators keep a non-finite
  value inside its own document (see below).

Isolation of non-finite values. An operator that mixes tokens with matrix products (attention,
KDA) masks other documents by *exact zero coefficients*; but ``0 * nan`` is ``nan``, so a NaN or
inf in one document would reach every token of the row through the zeros. Such operators
therefore replace non-finite inputs by zero (:func:`finite_or_zero`) before any cross-token
arithmetic and non-finite output gradients by zero (:func:`zero_nonfinite_grad`) before any
cross-token backward arithmetic. A finite input is unchanged bitwise, so every other document's
outputs and gradients are bitwise those of a clean run. The poisoned token itself keeps its NaN
wherever it flows without mixing (the residual stream of a model, so the loss still shows it);
what this operator returns for the poisoned document is unspecified.

Autocast. An operator's precision is its own contract (fp32 state, scores and sums, the output in
a documented input's dtype), the same inside ``torch.autocast`` as outside. Autocast would
otherwise reach the aten ops inside it, custom ops' kernels included (an unregistered custom op
is a fallthrough for the autocast key, so its kernel's matmuls run in bf16): KDA's in-chunk
inverses and the scans' states would be rounded to bf16, and tensors saved in bf16 would meet
fp32 gradients in a backward run outside the region (mixed-dtype matmuls: an error). So each
dispatcher runs its backend under :func:`autocast_off`: under autocast an operator returns,
bitwise, what it returns for the same tensors outside, and so does its backward run outside the
region (TRL's ``bf16=True`` and accelerate's mixed precision). The custom ops also register
autocast's fp32 rule (:func:`register_fp32_autocast`), for callers that reach them directly and
for a backward run under autocast. Such a backward (eager inside the region, or compiled: PyTorch
traces a compiled region's backward with its forward's autocast state unless
``torch._functorch.config.backward_pass_autocast = "off"``) still has autograd's formulas for
the aten matmuls of KDA's and GLA's chunk forms and of :func:`fcp.scan.fold_maps` autocast to
bf16 by PyTorch: their input gradients then carry more error against fp64 than a plain bf16 run
(``tests/test_autocast.py`` measures it). With ``backward_pass_autocast = "off"`` a compiled run equals the eager one, bitwise.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.checks import check_choice, check_float
from fcp.scan import autocast_off, register_fp32_autocast

__all__ = [
    "autocast_off",
    "choose_backend",
    "default_scale",
    "compute_dtype",
    "finite_or_zero",
    "register_fp32_autocast",
    "repeat_last",
    "scalar_tensor",
    "trim",
    "zero_nonfinite_grad",
]


def choose_backend(op: str, backend: str, allowed: tuple[str, ...], auto: str) -> str:
    """Validate ``backend`` for operator ``op`` and resolve ``"auto"`` to ``auto``.

    >>> choose_backend("kda", "auto", ("chunked", "fla"), "chunked")
    'chunked'
    """
    backend = check_choice(backend, "backend", ("auto", *allowed), fn=op)
    return auto if backend == "auto" else backend


def default_scale(head_dim: int, scale: float | None) -> float:
    """``head_dim ** -0.5`` when ``scale`` is ``None``, else ``float(scale)``."""
    return head_dim**-0.5 if scale is None else check_float(scale, "scale")


def scalar_tensor(value: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``value`` as a 0-d fp64 tensor on ``device``: the form in which a float (a softmax scale)
    reaches a custom op's kernel, which multiplies by it.

    Why not a ``float`` argument: under ``torch.compile(dynamic=True)`` a module's float
    attribute (``self.scaling``, an indexer's ``softmax_scale``) is a symbolic float, and a
    custom op's ``float`` argument specialises it, which restarts Dynamo's trace of the whole
    frame (it was 40% of a DSA layer's dynamic compile). As a tensor it stays an input of the
    graph: no restart, no recompile when the value changes. Built as ``ones * value``, the form
    Dynamo keeps symbolic (``torch.full``, ``as_tensor`` and ``scalar_tensor`` specialise it).

    Multiplying by it is bitwise multiplying by the Python float: either way the fp64 value is
    cast to the computation dtype before the product (``tests/test_gather_kernel.py`` checks).

    >>> x = torch.tensor([3.0])
    >>> torch.equal(x * scalar_tensor(0.1), x * 0.1)
    True
    """
    return torch.ones((), dtype=torch.float64, device=device) * value


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 whatever the input dtype (bf16/fp16/fp32), fp64 when an input is fp64."""
    dt = torch.float32
    for x in tensors:
        dt = torch.promote_types(dt, x.dtype)
    return dt


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and +-inf replaced by 0 (finite values unchanged; gradient 0 there)."""
    # |x| < inf is False exactly for NaN and +-inf: torch.isfinite's mask, ~3x cheaper on CPU
    finite = x.abs() < float("inf")
    return torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))


class _ZeroNonfiniteGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return finite_or_zero(grad)


def zero_nonfinite_grad(x: torch.Tensor) -> torch.Tensor:
    """Identity whose backward replaces non-finite gradient entries by 0."""
    return _ZeroNonfiniteGrad.apply(x)


def repeat_last(n: int, extra: int, device: torch.device | None = None) -> torch.Tensor:
    """int64 ``[n + extra]`` index ``0, 1, .., n - 1, n - 1, ..`` (``n >= 1``): indexing with it
    extends a sequence by repeating its last element ``extra`` times. Unlike ``torch.cat`` with
    an expanded tail, it has no special case for ``extra == 0``, so a compiled graph with a
    dynamic length does not specialise on it.

    >>> repeat_last(3, 2).tolist()
    [0, 1, 2, 2, 2]
    """
    return torch.arange(n + extra, device=device).clamp_(max=n - 1)


def trim(x: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` positions of ``x [batch, padded, ...]`` (dim 1) in ``dtype``, contiguous.

    Where padding is cut off, the result is a fresh contiguous copy: a strided slice would make
    later ``view``s check contiguity, and with a dynamic length that check is a guard that
    specialises the compiled graph on ``n`` modulo the padding multiple.
    """
    if statically_known_true(x.shape[1] == n):
        return x.to(dtype)
    part = x[:, :n]
    return part.new_empty(part.shape, dtype=dtype).copy_(part)  # no contiguity test of `part`
