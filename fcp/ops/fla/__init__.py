"""FLA interop: FLA's KDA and causal-conv kernels as compile-safe ``fcp::`` custom ops.

* :func:`build_fla_cp_context` - FLA's own ``FLACPContext`` for one row of the replicated doc-id
  map (host-side, memoised per row), field for field what ``fla.ops.cp.build_cp_context`` gives.
* :func:`fla_kda`, :func:`fla_short_conv` - drop-in for :func:`fcp.ops.kda.kda` /
  :func:`fcp.ops.conv.short_conv` (same signatures, plus ``mode=``): FLA on CUDA, pure PyTorch
  elsewhere (:func:`use_fla`).
* :func:`fla_kda_static` - static mode: dense FLA KDA, document resets through the gate, CP state
  chain by :func:`fcp.comm.state_chain` around the op. Compile- and CUDA-graph-safe.
* :func:`fla_kda_varlen`, :func:`fla_short_conv_varlen` - FLA's own varlen / ``cp_context`` path.
* :mod:`fcp.ops.fla.ops` - the custom ops (``fcp::fla_kda_fwd`` / ``_bwd``,
  ``fcp::fla_kda_varlen_fwd`` / ``_bwd``, ``fcp::fla_conv_varlen_fwd`` / ``_bwd``).

Importing this package does not import FLA (which costs ~15 s); the ops import it on their first
CUDA call, :func:`build_fla_cp_context` on its first call.
"""

from fcp.ops.fla.modes import (
    MODES,
    RESET_LOG_DECAY,
    fla_kda,
    fla_kda_eligible,
    fla_kda_static,
    fla_kda_varlen,
    fla_short_conv,
    fla_short_conv_varlen,
    reset_gate,
    use_fla,
)
from fcp.ops.fla.plan import build_fla_cp_context, fla_cp_fields

__all__ = [
    "MODES",
    "RESET_LOG_DECAY",
    "build_fla_cp_context",
    "fla_cp_fields",
    "fla_kda",
    "fla_kda_eligible",
    "fla_kda_static",
    "fla_kda_varlen",
    "fla_short_conv",
    "fla_short_conv_varlen",
    "reset_gate",
    "use_fla",
]
