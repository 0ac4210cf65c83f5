"""The family registry: every transformers family fcp runs, one row each (:class:`Family`).

A family is one module of this package holding its adapters (subclasses of a mixer kind of
:mod:`fcp.integrations.hf.mixers` that override the ``fcp_*`` steps where the model differs) and
its rows; its docstring says what fcp reads from transformers. Families that share adapters share
a module (Qwen3.5 / Qwen3.5-MoE, LFM2 / LFM2-MoE, the four Mamba2 hybrids). Everything that
lists families is derived from :data:`FAMILIES`: :data:`SUPPORTED` (what ``enable_packed_cp``
replaces), :func:`supported_families` (its refusal), :func:`model_table` (the transformers
guide's table, ``python -m fcp.integrations.hf.families table``) and :func:`model_list` (the
README's list, ``python -m fcp.integrations.hf.families list``).

Adding a family: a module here with its adapters and its ``FAMILIES`` rows (:class:`Family`:
transformers class names -> mixer, what crosses ranks, the tiny test config; the module is found
by :func:`family_modules`, nothing else lists it), and its parity tests against transformers
(``tests/test_hf_*.py``, which take the model and config from the row).
"""

from __future__ import annotations

import importlib
import pkgutil

from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import STEPS

__all__ = ["FAMILIES", "SUPPORTED", "Family", "family", "family_modules", "kind_of", "model_list",
           "model_table", "supported_families"]  # fmt: skip

#: The modules of this package that are not family modules.
NOT_FAMILIES = ("family", "__main__")


def family_modules() -> list:
    """Every family module of this package, by name: adding a family is adding its module,
    no list to extend."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_FAMILIES)
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


#: Every supported family: the rows of every family module, modules by name.
FAMILIES: tuple[Family, ...] = tuple(row for module in family_modules() for row in module.FAMILIES)

#: transformers class name -> the fcp mixer (a kind or a family's adapter) that replaces it.
SUPPORTED: dict[str, type[FcpMixer]] = {name: mixer for row in FAMILIES
                                        for name, mixer in row.mixers.items()}  # fmt: skip


def family(name: str) -> Family:
    """The row of the family ``name`` (transformers' model type, e.g. ``"qwen3_5"``)."""
    rows = {row.name: row for row in FAMILIES}
    if name not in rows:
        raise ValueError(f"unknown family {name!r}; known: {sorted(rows)}")
    return rows[name]


def kind_of(mixer: type[FcpMixer]) -> type[FcpMixer]:
    """The mixer kind ``mixer`` is (itself, or the kind an adapter subclasses); a mixer of no
    kind (a decoder layer's adapter) is its own."""
    return next((c for c in mixer.__mro__ if c in STEPS), mixer)


def supported_families() -> str:
    """One line per family: ``name (Title): class, class``, what ``enable_packed_cp`` names when
    a model holds no supported mixer."""
    return "\n".join(f"  {row.name} ({row.title}): {', '.join(sorted(row.mixers))}"
                     for row in FAMILIES)  # fmt: skip


def model_list(width: int = 100) -> str:
    """The README's list of families (Markdown, lines of at most ``width`` characters): their
    number, then ``Title (`name`)`` for each, by title."""
    rows = sorted(FAMILIES, key=lambda r: r.title.lower())
    words = [f"{row.title} (`{row.name}`)," for row in rows]
    words[-1] = words[-1][:-1] + "."
    lines, line = [], f"{len(FAMILIES)} families:"
    for word in words:
        if len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}"
    return "\n".join(lines + [line]) + "\n"


def model_table() -> str:
    """The transformers guide's model table (Markdown): family | transformers classes | mixer
    kinds | what crosses ranks per layer, one row per family."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a pipe would split the cell

    lines = ["| family | transformers classes | mixer kinds | what crosses ranks per layer |",
             "|---|---|---|---|"]  # fmt: skip
    for row in FAMILIES:
        classes = ", ".join(f"`{name}`" for name in row.mixers)
        kinds = ", ".join(dict.fromkeys(f"`{kind_of(m).__name__}`" for m in row.mixers.values()))
        lines.append(f"| {cell(row.title)} (`{row.name}`) | {cell(classes)} | {cell(kinds)} | "
                     f"{cell(row.crosses)} |")  # fmt: skip
    return "\n".join(lines) + "\n"
