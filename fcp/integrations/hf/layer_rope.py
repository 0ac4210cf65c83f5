"""The rotary parameters of one layer, for models whose layers rotate differently.

:func:`fcp.integrations.hf.rope.rope_tables` reads ``config.rope_parameters`` as one flat dict
(``{"rope_type": ..., "rope_theta": ..., ...}``). Some models give their layers their own:
Gemma 3 keeps one dict per layer type (``rope_parameters["sliding_attention"]`` with the local
base, ``["full_attention"]`` with the global base and its scaling), Granite-SWA one RoPE base per
layer (``layer_rope_theta[i]``; ``0``: NoPE). transformers builds one rotary embedding per such
set from a configuration that holds it (Granite-SWA deep-copies the config and replaces
``rope_parameters``). :class:`LayerRopeConfig` is that configuration without the copy: a view
of the model's config whose ``rope_parameters`` are the layer's flat dict::

    params = {**config.rope_parameters, "rope_theta": theta}            # this layer's
    cos, sin = rope_tables(LayerRopeConfig(config, params), positions, dtype)

Every other attribute reads through to ``config``, so transformers' scaled rope types
(``"linear"``, ``"yarn"``, ...) compute from it what they compute from the copy. Built inside a
compiled mixer, it traces (the frequencies become constants of the graph).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["LayerRopeConfig"]


class LayerRopeConfig:
    """``config`` with ``rope_parameters`` replaced by one layer's flat dict (module doc)."""

    def __init__(self, config: Any, rope_parameters: Mapping[str, Any]):
        self.config = config
        self.rope_parameters = dict(rope_parameters)

    def __getattr__(self, name: str) -> Any:
        # only for names the view does not hold: everything but the rotary parameters
        return getattr(self.config, name)

    def standardize_rope_params(self) -> None:
        """transformers' scaled rope types call this on the config they are given; the view's
        parameters come from a standardized config, and the model's own must stay as they are."""

