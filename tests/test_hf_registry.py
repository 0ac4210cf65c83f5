"""The family registry (:mod:`fcp.integrations.hf.families`) and the mixer kinds' step protocols
(:mod:`fcp.integrations.hf.mixers.protocols`) agree with everything derived from them:

* every transformers class of a row is in :data:`~fcp.integrations.hf.SUPPORTED`, mapped to the
  row's mixer, and nothing else is; ``enable_packed_cp``'s refusal names every family with its
  classes; every adapter a family module defines is in a row;
* every ``fcp_*`` step that a kind or an adapter defines has its kind's protocol signature
  (parameter names and kinds, classmethod / staticmethod / method), and a step name has one
  contract across all protocols;
* no two adapters are the same code;
* the transformers guide's model table is :func:`~fcp.integrations.hf.families.model_table` and
  the README's list :func:`~fcp.integrations.hf.families.model_list` (between the
  ``<!-- families:begin -->`` / ``<!-- families:end -->`` markers), which
  ``python -m fcp.integrations.hf.families table | list`` prints.

No transformers import: these read fcp's classes only (the parity of each family with
transformers: ``tests/test_hf_*.py``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fcp.integrations.hf.families as registry
from fcp.integrations.hf import SUPPORTED, FcpMixer, enable_packed_cp
from fcp.integrations.hf.families import FAMILIES, kind_of, model_list, model_table
from fcp.integrations.hf.mixers import STEPS
from fcp.integrations.hf.mixers.protocols import MixerSteps

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"


def family_modules() -> list:
    """Every module of the registry package (one per family or group of families)."""
    return [importlib.import_module(f"{registry.__name__}.{m.name}")
            for m in pkgutil.iter_modules(registry.__path__)]  # fmt: skip


def fcp_classes() -> set[type]:
    """Every fcp mixer class: the kinds, the registry's mixers and their fcp bases."""
    roots = set(STEPS) | set(SUPPORTED.values()) | {FcpMixer}
    return {c for r in roots for c in r.__mro__ if isinstance(c, type) and issubclass(c, FcpMixer)}


def protocol_of(cls: type) -> type:
    kind = kind_of(cls)
    return STEPS.get(kind, MixerSteps)


def raw(owner: type, name: str):
    """``(decorator type, function)`` of ``owner.name`` as defined (classmethod, staticmethod
    or a plain method)."""
    found = inspect.getattr_static(owner, name)
    return type(found), getattr(found, "__func__", found)


def shape(fn) -> tuple[list[tuple[str, str]], bool]:
    """``([(name, kind)] of every parameter but ``**kwargs``, whether it takes ``**kwargs``)``."""
    params = inspect.signature(fn).parameters.values()
    named = [(p.name, p.kind.name) for p in params if p.kind is not p.VAR_KEYWORD]
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def matches(step, contract) -> bool:
    """``step``'s signature is ``contract``'s: the same parameters (names and kinds) in order;
    where the contract takes ``**kwargs``, ``step`` may add keyword-only ones (a kind's own
    arguments of ``fcp_forward``) and must take ``**kwargs`` too."""
    (got, got_var), (want, want_var) = shape(step), shape(contract)
    if got_var != want_var:
        return False
    if want_var:
        got = [p for p in got if p[1] != "KEYWORD_ONLY" or p in want]
    return got == want


def own_steps(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items()
                  if n.startswith("fcp_") and (callable(v) or isinstance(v, (classmethod,
                                                                            staticmethod))))  # fmt: skip


def protocol_steps(protocol: type) -> list[str]:
    return sorted(n for n in vars(protocol) if n.startswith("fcp_"))


def test_supported_is_the_rows_mixers_and_nothing_else():
    names = [name for row in FAMILIES for name in row.mixers]
    assert len(names) == len(set(names)), "a transformers class in two rows"
    assert sorted(names) == sorted(SUPPORTED)
    for row in FAMILIES:
        assert all(SUPPORTED[name] is mixer for name, mixer in row.mixers.items()), row.name
    assert len({row.name for row in FAMILIES}) == len(FAMILIES)
    assert len(FAMILIES) >= 14, [row.name for row in FAMILIES]


def test_every_row_is_complete():
    for row in FAMILIES:
        assert re.fullmatch(r"[a-z0-9_]+", row.name), row.name
        assert row.title and row.crosses and row.text_model.endswith("Model"), row.name
        assert row.mixers and all(issubclass(m, FcpMixer) for m in row.mixers.values()), row.name
        assert row.test_config.get("vocab_size") and row.test_config.get("hidden_size"), row.name
        with pytest.raises(TypeError):  # rows are read-only: the registry is shared
            row.mixers["X"] = FcpMixer


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_refusal_names_every_family_and_its_classes(wrapped):
    model = torch.nn.Linear(2, 2)
    if wrapped:
        model = torch.nn.Sequential(model)
    with pytest.raises(ValueError, match=f"{type(model).__name__} has no supported") as error:
        enable_packed_cp(model)
    message = str(error.value)
    for row in FAMILIES:
        line = re.search(rf"^  {row.name} \((.*)\): (.*)$", message, re.MULTILINE)
        assert line, (row.name, message)
        assert line.group(1) == row.title and line.group(2).split(", ") == sorted(row.mixers)


def test_every_adapter_of_a_family_module_is_in_a_row():
    in_rows = set(SUPPORTED.values())
    for module in family_modules():
        defined = [c for c in vars(module).values() if isinstance(c, type)
                   and issubclass(c, FcpMixer) and c.__module__ == module.__name__]  # fmt: skip
        assert all(c in in_rows for c in defined), (module.__name__, defined)


def test_every_protocol_describes_its_kind():
    """Every kind has a protocol, and defines (or inherits) each of its steps."""
    kinds = {kind_of(m) for m in SUPPORTED.values()} - {FcpMixer}
    assert {k for k in kinds if k in STEPS} == {k for k in kinds if issubclass(k, tuple(STEPS))}
    for kind, protocol in STEPS.items():
        assert MixerSteps in protocol.__mro__, protocol
        for name in dir(protocol):
            if name.startswith("fcp_"):
                assert hasattr(kind, name), (kind.__name__, name)


def test_one_contract_per_step_name():
    contracts: dict[str, tuple] = {}
    for protocol in {MixerSteps, *STEPS.values()}:
        for name in protocol_steps(protocol):
            decorator, fn = raw(protocol, name)
            here = (decorator, shape(fn))
            assert contracts.setdefault(name, here) == here, (name, protocol.__name__)


@pytest.mark.parametrize("cls", sorted(fcp_classes(), key=lambda c: c.__qualname__),
                         ids=lambda c: c.__name__)  # fmt: skip
def test_every_step_has_its_protocol_signature(cls):
    protocol = protocol_of(cls)
    for name in own_steps(cls):
        assert hasattr(protocol, name), f"{cls.__name__}.{name} is no step of {protocol.__name__}"
        (decorator, step), (want_decorator, contract) = raw(cls, name), raw(protocol, name)
        assert decorator is want_decorator, (cls.__name__, name, decorator, want_decorator)
        assert matches(step, contract), (f"{cls.__name__}.{name}{inspect.signature(step)} is not "
                                         f"{protocol.__name__}.{name}"
                                         f"{inspect.signature(contract)}")  # fmt: skip


def code_of(fn) -> str:
    """The function's body as an AST dump, docstring and name left out."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = node.body[1:] if ast.get_docstring(node) else node.body
    return ast.dump(ast.Module(body=body, type_ignores=[])) + ast.dump(node.args)


def test_no_two_adapters_are_the_same_code():
    adapters = {m for m in SUPPORTED.values() if m not in STEPS}
    seen: dict[tuple, type] = {}
    for adapter in sorted(adapters, key=lambda c: c.__qualname__):
        key = (adapter.__bases__, frozenset((n, code_of(raw(adapter, n)[1]))
                                            for n in own_steps(adapter)))  # fmt: skip
        assert key not in seen, f"{adapter.__name__} is {seen[key].__name__} again"
        seen[key] = adapter


def test_the_table_has_one_row_per_family_and_no_stray_pipe():
    lines = model_table().splitlines()
    assert len(lines) == 2 + len(FAMILIES)
    for line, row in zip(lines[2:], FAMILIES):
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 4 and f"`{row.name}`" in cells[0], line


@pytest.mark.parametrize("what", ["table", "list"])
def test_the_command_line_prints_the_table_and_the_list(what):
    out = subprocess.run([sys.executable, "-m", "fcp.integrations.hf.families", what], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout  # fmt: skip
    assert out == (model_table() if what == "table" else model_list())


def _block(path: str) -> str:
    text = (ROOT / path).read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{path} has no families block"
    return text.split(BEGIN)[1].split(END)[0].strip("\n")


def test_the_guide_table_and_the_readme_list_are_the_registry():
    """Regenerate them with ``python -m fcp.integrations.hf.families table`` (the transformers
    guide) and ``... list`` (the README)."""
    assert _block("docs/guides/transformers.md") == model_table().strip("\n"), (
        "the transformers guide's model table differs from the registry: regenerate it with "
        "`python -m fcp.integrations.hf.families table`")  # fmt: skip
    assert _block("README.md") == model_list().strip("\n"), (
        "README's list of families differs from the registry: regenerate it with "
        "`python -m fcp.integrations.hf.families list`")  # fmt: skip
    assert all(len(line) <= 100 for line in model_list().splitlines())
