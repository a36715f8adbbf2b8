"""The shape of the source tree: which way imports point, no import circle, no private name used outside its module,
no oversized engine module.

The rules (docs/ARCHITECTURE.md, "Which way the arrows point"):

* ``regkit`` never imports the apps (``regkit_cli``, ``napari_regkit``) or ``benchmarks``, and reaches
  ``regkit_kernels`` only from ``regkit/_backend.py``; ``regkit_kernels`` imports none of the others; the two apps
  do not import each other; nothing shipped imports ``benchmarks``.
* No circle among the modules of one package (imports under ``if TYPE_CHECKING:`` do not count: they never run).
* A private name (``_name``) is used only in its module. A private module (``regkit/_backend.py``) is private to its
  top-level package: used there and by that package's tests (``tests/regkit/...``).
* A module of ``regkit`` over 500 lines says why in its docstring (``Over 500 lines because ...``).

The scan is static (``ast``): it sees every ``import`` statement, also the lazy ones inside functions.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package name -> its folder
PACKAGES = {
    "regkit": ROOT / "regkit",
    "regkit_kernels": ROOT / "kernels" / "regkit_kernels",
    "regkit_cli": ROOT / "apps" / "regkit_cli",
    "napari_regkit": ROOT / "apps" / "napari_regkit",
    "benchmarks": ROOT / "benchmarks",
}
# what each package may import, of the others
ALLOWED = {
    "regkit": {"regkit_kernels"},
    "regkit_kernels": set(),
    "regkit_cli": {"regkit", "regkit_kernels"},
    "napari_regkit": {"regkit"},
    "benchmarks": {"regkit", "regkit_kernels", "regkit_cli"},
}
MAX_LINES = 500


@dataclass(frozen=True)
class Import:
    """One imported name: ``module`` (absolute) and ``name`` (an attribute of it, or None for ``import module``)."""

    file: Path
    line: int
    module: str
    name: str | None
    typing_only: bool


def module_name(path: Path) -> str:
    """``regkit/cpab/basis.py`` -> ``regkit.cpab.basis``; ``tests/regkit/x.py`` -> ``tests.regkit.x``."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("kernels", "apps"):
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def sources() -> list[Path]:
    """Every Python file of the packages and the tests."""
    files = [p for folder in PACKAGES.values() for p in folder.rglob("*.py")]
    return sorted(files + list((ROOT / "tests").rglob("*.py")))


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> list[Import]:
    """The imports of one file, with relative imports made absolute."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(path, node.lineno, a.name, None, typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.extend(Import(path, node.lineno, module, a.name, typing_only) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def our_modules() -> set[str]:
    return {module_name(p) for p in sources()}


def owner(path: Path) -> str:
    """The top-level package a file belongs to; a test belongs to the package its folder mirrors."""
    me = module_name(path)
    if me.startswith("tests."):
        return me.split(".")[1]
    return top(me)


def test_imports_point_one_way():
    wrong = []
    for path in sources():
        me = module_name(path)
        if me.startswith("tests"):
            continue
        for imp in imports(path):
            other = top(imp.module)
            if other in PACKAGES and other != top(me) and other not in ALLOWED[top(me)]:
                wrong.append(f"{path.relative_to(ROOT)}:{imp.line}: {top(me)} imports {imp.module}")
            if top(me) == "regkit" and other == "regkit_kernels" and not imp.typing_only and me != "regkit._backend":
                wrong.append(f"{path.relative_to(ROOT)}:{imp.line}: regkit reaches {imp.module} outside _backend")
    assert not wrong, "\n".join(wrong)


def graph() -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (at run time)."""
    known = our_modules()
    edges: dict[str, set[str]] = {}
    for path in sources():
        me = module_name(path)
        if me.startswith("tests"):
            continue
        targets = edges.setdefault(me, set())
        for imp in imports(path):
            if imp.typing_only or top(imp.module) != top(me):
                continue
            submodule = f"{imp.module}.{imp.name}" if imp.name else None
            target = submodule if submodule in known else imp.module
            if target in known and target != me:
                targets.add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def test_no_import_circle():
    found = cycles(graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_no_private_name_outside_its_module():
    known = our_modules()
    wrong = []
    for path in sources():
        me = module_name(path)
        mine = owner(path)
        aliases: dict[str, str] = {}  # local name -> one of our modules
        for imp in imports(path):
            if top(imp.module) not in PACKAGES:
                continue
            parts = imp.module.split(".")
            private_module = next((i for i, p in enumerate(parts) if is_private(p)), None)
            if private_module is not None and mine != top(imp.module):
                wrong.append(f"{path.relative_to(ROOT)}:{imp.line}: private module {imp.module}")
            if imp.name is None:
                aliases[parts[0]] = parts[0]
                continue
            submodule = f"{imp.module}.{imp.name}"
            if submodule in known:
                aliases[imp.name] = submodule
                if is_private(imp.name) and mine != top(imp.module):
                    wrong.append(f"{path.relative_to(ROOT)}:{imp.line}: private module {submodule}")
            elif is_private(imp.name) and imp.module != me:
                wrong.append(f"{path.relative_to(ROOT)}:{imp.line}: {imp.module}.{imp.name}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and is_private(node.attr) and isinstance(node.value, ast.Name):
                module = aliases.get(node.value.id)
                if module is not None and module != me and f"{module}.{node.attr}" not in known:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_engine_modules_are_small_or_say_why():
    wrong = []
    for path in sorted((ROOT / "regkit").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_LINES and f"Over {MAX_LINES} lines because" not in (ast.get_docstring(ast.parse(text)) or ""):
            wrong.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not wrong, "\n".join(wrong)
