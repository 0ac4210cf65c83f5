"""The documentation runs: every docstring example of fcp is a doctest, run here on CPU."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

FCP = Path(__file__).resolve().parents[1] / "fcp"
MODULES = sorted(
    ".".join(p.relative_to(FCP.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in FCP.rglob("*.py")
)
# CUDA-only backends import FLA / Triton at module level only inside functions; every module
# imports on CPU, so every module is checked.


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_there_are_examples():
    attempted = sum(
        doctest.testmod(importlib.import_module(n), report=False).attempted for n in MODULES
    )
    assert attempted >= 20, attempted
