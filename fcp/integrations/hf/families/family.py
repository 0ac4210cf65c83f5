"""One declarative row per transformers family (:class:`Family`): what fcp replaces in it, and
with what.

A family module (``fcp/integrations/hf/families/<name>.py``) holds the family's adapters and its
row; :mod:`fcp.integrations.hf.families` collects the rows, and everything that lists families
(:data:`~fcp.integrations.hf.SUPPORTED`, ``enable_packed_cp``'s refusal, the README's model
table) is derived from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fcp.integrations.hf.core import FcpMixer

__all__ = ["Family"]


@dataclass(frozen=True)
class Family:
    """A transformers family on fcp.

    * ``name``: transformers' model type of the family's top-level config, which is also its
      module (``transformers.models.<name>``): ``"qwen3_5"``;
    * ``title``: the name people use: ``"Qwen3.5"``;
    * ``mixers``: transformers class name -> the fcp mixer that replaces it (a mixer kind of
      :mod:`fcp.integrations.hf.mixers` as it is, or a family's adapter: a subclass of a kind
      overriding some of its ``fcp_*`` steps);
    * ``crosses``: what one layer of each kind sends between CP ranks (Markdown, one line);
    * ``text_model``: the transformers class of the text backbone the parity tests build
      (``transformers.models.<name>.modeling_<name>.<text_model>``; its ``config_class`` takes
      ``test_config``);
    * ``test_config``: the tiny configuration of the parity tests (``tests/test_hf_*.py``):
      keyword arguments of that config class.

    ``mixers`` and ``test_config`` are read-only views.
    """

    name: str
    title: str
    mixers: Mapping[str, type[FcpMixer]]
    crosses: str
    text_model: str
    test_config: Mapping[str, Any]

    def __post_init__(self):
        # frozen rows: the registry is shared by every caller, nobody may edit it in place
        object.__setattr__(self, "mixers", MappingProxyType(dict(self.mixers)))
        object.__setattr__(self, "test_config", MappingProxyType(dict(self.test_config)))

    @classmethod
    def of(cls, name: str, title: str, text_model: str, test_config: Mapping[str, Any],
           crosses: str, **mixers: type[FcpMixer]) -> Family:  # fmt: skip
        """A row with its mixers by keyword, transformers class name = fcp mixer::

            Family.of("lfm2", "LFM2", "Lfm2Model", {...}, "...",
                      Lfm2ShortConv=GatedShortConvMixer, Lfm2Attention=Lfm2AttentionAdapter)
        """
        return cls(name=name, title=title, mixers=mixers, crosses=crosses, text_model=text_model,
                   test_config=test_config)  # fmt: skip
