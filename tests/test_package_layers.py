"""The package's import structure, read statically from its sources (every import, also those inside
functions, which only defer a circle): no import circles, the compiler's stages layered
(graph <- codegen / paged <- partition, build, export), kernels and run time free of the compiler
and the models, no class name defined twice, no use of another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mqa_byoc

ROOT = Path(mqa_byoc.__file__).resolve().parent
PKG = "mqa_byoc"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _sources()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_lines(tree) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (imports for type checkers only)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """[(imported module, imported names (from-imports) or None, line)] of one of our modules."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((_resolve(module, node), [a.name for a in node.names], node.lineno))
    return out


def _edges(module: str) -> set[str]:
    """The modules of ours that ``module`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    found = set()
    for target, names, _ in _imports(module):
        if not (target == PKG or target.startswith(PKG + ".")):
            continue
        subs = [f"{target}.{n}" for n in names or () if f"{target}.{n}" in MODULES]
        if subs:
            found.update(subs)
            if len(subs) < len(names):
                found.add(target)
        elif target in MODULES:
            found.add(target)
    found.discard(module)
    return found


GRAPH = {m: _edges(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_is_read():
    # a few edges known to exist, so that an empty graph cannot pass the tests below
    assert "mqa_byoc.compiler.graph.site" in GRAPH["mqa_byoc.compiler.graph.analysis"]
    assert "mqa_byoc.compiler.graph.varlen" in GRAPH["mqa_byoc.compiler.graph.analysis"]
    assert "mqa_byoc.compiler.provider" in GRAPH["mqa_byoc.compiler.codegen.dispatch"]
    assert "mqa_byoc.runtime.varlen_provider" in GRAPH["mqa_byoc.runtime.providers"]


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_no_import_circles_inside_the_compiler():
    compiler = {m: {e for e in es if e.startswith(f"{PKG}.compiler.")} for m, es in GRAPH.items()
                if m.startswith(f"{PKG}.compiler.")}
    assert len(compiler) >= 20
    assert _cycles(compiler) == []


# the compiler's stages and the package's layers: a module under the key imports none of the values
FORBIDDEN = {
    f"{PKG}.compiler.graph": (f"{PKG}.compiler.codegen", f"{PKG}.compiler.paged", f"{PKG}.compiler.provider",
                              f"{PKG}.compiler.partition", f"{PKG}.compiler.build", f"{PKG}.compiler.export",
                              f"{PKG}.models", f"{PKG}.runtime"),
    f"{PKG}.compiler.codegen": (f"{PKG}.compiler.paged", f"{PKG}.compiler.partition", f"{PKG}.compiler.build",
                                f"{PKG}.compiler.export", f"{PKG}.models", f"{PKG}.runtime"),
    f"{PKG}.compiler.paged": (f"{PKG}.compiler.codegen", f"{PKG}.compiler.partition", f"{PKG}.compiler.build",
                              f"{PKG}.models", f"{PKG}.runtime"),
    f"{PKG}.kernels": (f"{PKG}.compiler", f"{PKG}.models", f"{PKG}.runtime", f"{PKG}.cli", f"{PKG}.demo"),
    f"{PKG}.runtime": (f"{PKG}.compiler", f"{PKG}.models", f"{PKG}.cli", f"{PKG}.demo"),
    f"{PKG}.contract": (f"{PKG}.compiler", f"{PKG}.kernels", f"{PKG}.models", f"{PKG}.runtime"),
}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers(layer):
    # a package's ``__main__`` is a command-line entry point, above every layer
    bad = sorted((m, e) for m, es in GRAPH.items() if _under(m, layer) and not m.endswith(".__main__")
                 for e in es if any(_under(e, f) for f in FORBIDDEN[layer]))
    assert bad == []


def test_no_class_name_defined_twice():
    seen: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_no_private_names_of_other_modules():
    """``from ours import _name`` and ``ours_module._name`` across modules (a module's own privates and
    dunder names are fine)."""
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for target, names, line in _imports(module):
            if not target.startswith(PKG):
                continue
            for n in names or ():
                if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in MODULES:
                    bad.append(f"{module}:{line} imports {target}.{n}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                for a in node.names:
                    if f"{target}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and aliases[node.value.id] != module:
                bad.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert bad == []
