"""Bound Triton autotuning (for time-boxed GPU checks).

FLA autotunes every kernel over up to ~36 configs; a cold KDA forward + backward compiles ~150
kernel variants per (dtype, head layout, varlen flag), minutes on a fresh machine.
:func:`limit_triton_autotune` keeps only the ``max_configs`` lightest configs of each autotuned
kernel (fewest pipeline stages, about 4 warps, smallest blocks: the ones least likely to exceed
shared memory). Any config computes the same result; only speed differs, equally for FLA's dense
and varlen kernels (same config lists), so static/varlen time ratios stay meaningful.
"""

from __future__ import annotations

import math
import os

__all__ = ["limit_triton_autotune", "limit_from_env"]

ENV = "FCP_FLA_AUTOTUNE_MAX"


def _cost(config) -> tuple:
    blocks = math.prod(v for v in config.kwargs.values() if isinstance(v, int) and v > 0)
    warps = config.num_warps or 4
    return (config.num_stages or 1, abs(math.log2(warps) - 2), blocks)


def limit_triton_autotune(max_configs: int) -> None:
    """Autotune over at most ``max_configs`` configs per kernel (``<= 0``: Triton's default).

    Process-global; call before the first kernel launch of a shape (results already tuned stay).
    """
    from triton.runtime import autotuner

    cls = autotuner.Autotuner
    original = getattr(cls.prune_configs, "_fcp_original", cls.prune_configs)
    if max_configs <= 0:
        cls.prune_configs = original
        return

    def prune_configs(self, kwargs):
        configs = original(self, kwargs)
        if len(configs) <= max_configs:
            return configs
        return sorted(configs, key=_cost)[:max_configs]

    prune_configs._fcp_original = original
    cls.prune_configs = prune_configs


def limit_from_env(default: int = 0) -> int:
    """Apply ``FCP_FLA_AUTOTUNE_MAX`` (or ``default``) and return the limit used."""
    limit = int(os.environ.get(ENV, default))
    limit_triton_autotune(limit)
    return limit
