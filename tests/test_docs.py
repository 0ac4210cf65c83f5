"""The documentation runs.

* Every docstring example of fcp is a doctest, run here on CPU.
* Every ```python block of ``docs/**/*.md`` runs, as the README's do (``tests/test_readme.py``):
  a block runs alone, in a fresh namespace, in this process; a block right after the comment
  ``<!-- ranks: N -->`` runs on N gloo ranks of the session's rank pool (as a script launched with
  ``torchrun --nproc-per-node N`` would); a block right after ``<!-- not run: why -->`` is a
  fragment and is skipped, and the reason is required. Fragments stay few
  (:data:`MAX_NOT_RUN`).
* ``mkdocs build --strict`` builds the site (skipped only where mkdocs is not installed).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
FCP = ROOT / "fcp"
DOCS = ROOT / "docs"
MODULES = sorted(
    ".".join(p.relative_to(FCP.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in FCP.rglob("*.py")
)
# CUDA-only backends import FLA / Triton at module level only inside functions; every module
# imports on CPU, so every module is checked.

#: At most this many python blocks of the docs may be marked ``<!-- not run: why -->``.
MAX_NOT_RUN = 4


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


def test_package_docstring_layers_match_the_architecture_test():
    """``fcp``'s docstring lists the layers of ``tests/test_architecture.py``, each module at its
    number."""
    import fcp
    from tests.test_architecture import layer

    items = re.findall(r"^(\d)\. (.*?)(?=^\d\. |\n\n)", fcp.__doc__, flags=re.S | re.M)
    assert [int(n) for n, _ in items] == list(range(8)), [n for n, _ in items]
    for n, text in items:
        for mod in re.findall(r":mod:`(fcp[\w.]*)`", text):
            assert layer(mod)[0] == int(n), f"fcp's docstring puts {mod} in layer {n}"


# -- the docs' python blocks --------------------------------------------------------------------


class Block(NamedTuple):
    where: str  # "docs/page.md:line"
    mark: str  # "" (run here), "ranks: N" or "not run: why"
    code: str


_FENCE = re.compile(r"^(?:<!--(?P<mark>[^\n]*?)-->\n)?```python[^\n]*\n(?P<code>.*?)^```",
                    flags=re.S | re.M)  # fmt: skip
_MARK = re.compile(r"ranks: [1-4]|not run: \S.*")


def doc_blocks() -> list[Block]:
    """Every ```python block of ``docs/**/*.md``, with the mark in the comment right before it."""
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            mark = (m.group("mark") or "").strip()
            where = f"{page.relative_to(ROOT)}:{line}"
            assert mark == "" or _MARK.fullmatch(mark), f"{where}: unknown mark <!-- {mark} -->"
            blocks.append(Block(where, mark, m.group("code")))
    return blocks


BLOCKS = doc_blocks()


def run_block(code: str, where: str) -> dict:
    scope = {"__name__": "__main__"}
    exec(compile(code, where, "exec"), scope)
    return scope


def test_docs_have_python_blocks():
    assert sum(not b.mark for b in BLOCKS) >= 5 and any(b.mark.startswith("ranks") for b in BLOCKS)
    # the fence regex finds every block the pages open
    opened = sum(p.read_text().count("```python") for p in DOCS.rglob("*.md"))
    assert opened == len(BLOCKS), (opened, len(BLOCKS))


def test_fragments_are_few_and_say_why():
    fragments = [b.where for b in BLOCKS if b.mark.startswith("not run")]
    assert len(fragments) <= MAX_NOT_RUN, fragments


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.mark], ids=lambda b: b.where)
def test_doc_block_runs(block):
    run_block(block.code, block.where)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark.startswith("ranks")],
                         ids=lambda b: b.where)  # fmt: skip
def test_doc_block_runs_on_ranks(rank_pool, block):
    from tests import _readme_rank_fns as fns

    world = int(block.mark.split(":")[1])
    rank_pool.run(fns.doc_block, world, block.code, block.where, timeout=120)


# -- the site ------------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "operators" / "index.html").exists()
