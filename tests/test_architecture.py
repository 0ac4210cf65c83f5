"""The shape of the package: layers read bottom up, no cycles, no private names across modules,
and every operator folder shaped alike.

Layers (a module may import only its own layer or lower ones):

    0  fcp.checks, fcp.layout, fcp.groups, fcp.pytree, fcp.scan
    1  fcp.context
    2  fcp.comm
    3  fcp.shard, fcp.loss
    4  fcp.ops, fcp.ops.kit.* (the operators' shared toolkit)
    5  fcp.ops.<operator> (conv, kda, doc_causal, ...): never another operator's folder
    6  fcp.models, fcp.integrations
    7  fcp (the package's public namespace)

Operator folders (``fcp/ops/<operator>/``): ``__init__.py`` is the only dispatcher (it checks
arguments, chooses a backend from ``BACKENDS`` and calls it; it moves no data, so it never imports
``fcp.comm``); ``reference.py`` is only the oracle (nothing but other references and tests imports
it); every other module is a backend (what the dispatcher imports), or a piece the backends share,
reached from ``__init__``; no backend imports another backend. Integrations run no collective of
their own: nothing in ``fcp.integrations`` imports ``fcp.comm``.

The model side's shape (the family registry, the supported list and the README's table agree;
every ``fcp_*`` override has its kind's protocol signature) is checked in
``tests/test_hf_registry.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

FCP = Path(__file__).resolve().parents[1] / "fcp"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(FCP.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in FCP.rglob("*.py")}


def layer(mod: str) -> tuple[int, str]:
    """``(layer, group)``: modules of one operator folder share a group."""
    fixed = {"fcp.checks": 0, "fcp.layout": 0, "fcp.groups": 0, "fcp.pytree": 0, "fcp.scan": 0, "fcp.context": 1,
             "fcp.comm": 2,
             "fcp.shard": 3, "fcp.loss": 3, "fcp.ops": 4, "fcp": 7}  # fmt: skip
    if mod in fixed:
        return fixed[mod], mod
    parts = mod.split(".")
    if parts[:3] == ["fcp", "ops", "kit"]:
        return 4, mod
    if parts[1] == "ops":
        return 5, ".".join(parts[:3])
    if parts[1] in ("models", "integrations"):
        return 6, ".".join(parts[:3])
    raise AssertionError(f"{mod} has no layer; add it to this test's table")


def imports(mod: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` of every fcp import in ``mod``."""
    path = MODULES[mod]
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("fcp")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("fcp"):
                continue
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            plain = [n for n in names if f"{base}.{n}" not in MODULES]
            out += [(s, [], node.lineno) for s in subs]
            if plain or not subs:
                out.append((base, plain, node.lineno))
    return out


def test_every_import_goes_down_or_sideways_within_one_operator():
    bad = []
    for mod in MODULES:
        src_layer, src_group = layer(mod)
        for target, _, line in imports(mod):
            if target not in MODULES:
                bad.append(f"{mod}:{line} imports unknown {target}")
                continue
            t_layer, t_group = layer(target)
            if t_layer > src_layer:
                bad.append(f"{mod}:{line} (layer {src_layer}) imports {target} (layer {t_layer})")
            elif t_layer == src_layer == 5 and t_group != src_group:
                bad.append(f"{mod}:{line}: operator {src_group} imports operator {t_group}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in imports(m) if t in MODULES} for m in MODULES}
    # a package's __init__ re-exporting its own submodules is not a cycle of the layering
    for m in graph:
        if MODULES[m].name == "__init__.py":
            graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state, stack, cycles = {}, [], []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in graph[u]:
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_no_private_name_is_used_outside_its_module():
    bad = []
    for mod, path in MODULES.items():
        for target, names, line in imports(mod):
            bad += [f"{mod}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name.split(".")[-1] for n in ast.walk(tree)
                   if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
                   if (getattr(n, "module", "") or a.name).startswith("fcp")}  # fmt: skip
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):  # fmt: skip
                bad.append(f"{mod}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_environment_variable_or_global_statement_chooses_behaviour():
    """Backends are chosen by arguments: nothing reads the environment, nothing rebinds a module
    global at run time (which is what tests would otherwise patch)."""
    bad = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                bad.append(f"{mod}:{node.lineno} global {', '.join(node.names)}")
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                bad.append(f"{mod}:{node.lineno} reads os.{node.attr}")
    assert not bad, "\n".join(bad)


OPERATORS = sorted({m.split(".")[2] for m in MODULES
                    if m.startswith("fcp.ops.") and m.count(".") >= 2 and m.split(".")[2] != "kit"})


def test_every_operator_folder_has_a_dispatcher_and_a_reference():
    assert len(OPERATORS) >= 7, OPERATORS
    for op in OPERATORS:
        assert f"fcp.ops.{op}" in MODULES and MODULES[f"fcp.ops.{op}"].name == "__init__.py", op
        assert f"fcp.ops.{op}.reference" in MODULES, f"fcp/ops/{op}/ has no reference.py"
        tree = ast.parse(MODULES[f"fcp.ops.{op}"].read_text())
        assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}  # fmt: skip
        assert "BACKENDS" in assigned, f"fcp.ops.{op} defines no BACKENDS"


def test_only_references_import_references():
    bad = []
    for mod in MODULES:
        for target, _, line in imports(mod):
            if target.endswith(".reference") and not mod.endswith(".reference"):
                bad.append(f"{mod}:{line} imports the oracle {target}")
    assert not bad, "\n".join(bad)


def test_dispatchers_move_no_data():
    bad = [f"fcp.ops.{op}:{line} imports {target}" for op in OPERATORS
           for target, _, line in imports(f"fcp.ops.{op}") if target == "fcp.comm"]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_every_backend_module_is_reached_from_its_dispatcher():
    for op in OPERATORS:
        folder = [m for m in MODULES if m.startswith(f"fcp.ops.{op}.")]
        reached, todo = set(), [f"fcp.ops.{op}"]
        while todo:
            mod = todo.pop()
            for target, _, _ in imports(mod):
                if target.startswith(f"fcp.ops.{op}.") and target not in reached:
                    reached.add(target)
                    todo.append(target)
        stray = [m for m in folder if m not in reached and not m.endswith(".reference")]
        assert not stray, f"fcp.ops.{op}: modules no backend path uses: {stray}"


def backend_modules(op: str) -> set[str]:
    """The folder's backends: the modules its dispatcher reaches directly (the reference aside);
    modules only backends reach are pieces they share."""
    return {t for t, _, _ in imports(f"fcp.ops.{op}")
            if t.startswith(f"fcp.ops.{op}.") and not t.endswith(".reference")}  # fmt: skip


def test_no_backend_imports_another_backend():
    bad = []
    for op in OPERATORS:
        backends = backend_modules(op)
        for mod in backends:
            bad += [f"{mod}:{line} imports the backend {target}"
                    for target, _, line in imports(mod) if target in backends - {mod}]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_integrations_move_no_data():
    """Model adapters call operators; every exchange between ranks is an operator's (with its
    reference and property tests), so nothing in ``fcp.integrations`` imports ``fcp.comm``."""
    bad = [f"{mod}:{line} imports {target}" for mod in MODULES if mod.startswith("fcp.integrations")
           for target, _, line in imports(mod) if target == "fcp.comm"]  # fmt: skip
    assert not bad, "\n".join(bad)
