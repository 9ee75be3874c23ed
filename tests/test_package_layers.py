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


# ------------------------------------------------------------------------------------------------
# the checkout's trees around the package: tests, tools and benchmarks share code only through the
# package (mqa_byoc.testing: graph builders, GPU cases, manifests), never by importing one another

CHECKOUT = Path(__file__).resolve().parents[1]
TREES = ("tests", "tools", "benchmarks")
# A tree may not import the modules of the trees listed for it, nor put their folders on sys.path.
NO_REACH = {"tests": ("tools", "benchmarks"), "tools": ("tests", "benchmarks"), "benchmarks": ("tests", "tools")}
# The unit test of a benchmark's own logic imports that benchmark (its subject, not a shared helper).
BENCHMARK_TESTS = {"tests/test_bench_attention_report.py": {"attention_bench"}}


def _tree_files(tree: str) -> list[Path]:
    return sorted(p for p in (CHECKOUT / tree).rglob("*.py") if "__pycache__" not in p.parts
                  and not p.relative_to(CHECKOUT / tree).parts[0].startswith("."))


def _top_level_names(tree: str) -> set[str]:
    """The names a tree's files are imported by when their folder is on sys.path: every module file's
    stem and every package folder (with an ``__init__.py``) of the tree."""
    names = set()
    for p in _tree_files(tree):
        names.add(p.parent.name if p.name == "__init__.py" else p.stem)
    return names - {"__init__", "__main__", "conftest", "setup"}


def _reaches(path: Path, others: dict[str, set[str]], root: Path = CHECKOUT) -> list[str]:
    """What ``path`` imports of the other trees' modules; and, where it edits ``sys.path``, the other
    trees' folders it names (a string ``"tools"``, ``"tools/..."``, ``".../tools"``: what a path to
    them is made of)."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(root)
    found, edits_path, strings = [], [], []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        for name in names:
            for other, mods in others.items():
                if name.split(".")[0] in mods:
                    found.append(f"{where}:{node.lineno} imports {name} ({other}/)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path":
            edits_path.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                ast.unparse(t).startswith("sys.path") for t in getattr(node, "targets", [getattr(node, "target", None)])):
            edits_path.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
            strings.append((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and not isinstance(node.left, (ast.BinOp, ast.Constant)):
            strings.append((node.lineno, node.right.value))  # ROOT / "tools": a folder of the checkout
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join":
            strings += [(node.lineno, a.value) for a in node.args[1:2] if isinstance(a, ast.Constant)
                        and not isinstance(node.args[0], ast.Constant)]
    if edits_path:
        for other in others:
            for line, text in strings:
                if text == other or str(text).startswith(other + "/") or str(text).endswith("/" + other):
                    found.append(f"{where}:{line} names {text!r} and edits sys.path (line {edits_path[0]})")
    return found


def test_the_reach_finder_finds_a_reach(tmp_path):
    probe = tmp_path / "t.py"
    probe.write_text("import sys\nTOOLS = ROOT / 'tools' / 'gpu'\nsys.path.insert(0, str(TOOLS))\n"
                     "import build_forms\nfrom gpu_common import x\n")
    found = _reaches(probe, {"tools": {"build_forms"}, "tests": {"gpu_common"}}, root=tmp_path)
    assert [f.split(" ")[1] for f in found] == ["imports", "imports", "names"], found
    probe.write_text("import sys\nsys.path.insert(0, str(ROOT / 'src'))\nimport mqa_byoc\n")
    assert _reaches(probe, {"tools": {"build_forms"}}, root=tmp_path) == []


def test_trees_do_not_import_each_other():
    names = {t: _top_level_names(t) for t in TREES}
    assert {"build_forms", "bundle"} <= names["tools"] and "gpu_common" in names["tests"] \
        and "attention_bench" in names["benchmarks"]  # the trees are read
    bad = []
    for tree in TREES:
        for path in _tree_files(tree):
            allowed = BENCHMARK_TESTS.get(str(path.relative_to(CHECKOUT)), set())
            others = {o: names[o] - names[tree] - allowed for o in NO_REACH[tree]}
            if allowed:  # its benchmark's folder on sys.path, to import it
                others.pop("benchmarks")
                bad += [r for r in _reaches(path, {"benchmarks": names["benchmarks"] - allowed})
                        if " imports " in r]
            bad += _reaches(path, others)
    assert bad == []
