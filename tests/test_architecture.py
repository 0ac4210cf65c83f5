"""The shape of the package: layers read bottom up, no cycles, no private names across modules.

Layers (a module may import only its own layer or lower ones):

    0  fcp.checks, fcp.layout, fcp.groups, fcp.pytree, fcp.scan
    1  fcp.context
    2  fcp.comm
    3  fcp.shard, fcp.loss
    4  fcp.ops.common, fcp.ops.fla_support, fcp.ops.doc_pools
    5  fcp.ops.<operator> (conv, kda, attention, ...): never another operator's folder
    6  fcp.models, fcp.integrations
    7  fcp (the package's public namespace)
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
             "fcp.shard": 3, "fcp.loss": 3, "fcp.ops.common": 4, "fcp.ops.fla_support": 4, "fcp.ops": 4,
             "fcp.ops.doc_pools": 4, "fcp": 7}  # fmt: skip
    if mod in fixed:
        return fixed[mod], mod
    parts = mod.split(".")
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
