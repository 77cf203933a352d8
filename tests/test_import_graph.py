"""The package's own modules import each other without circles.

The graph is built statically with ``ast`` from the source files under ``ktransformers/`` (nothing
is imported, so it needs neither torch nor the C++ extension).  Every ``import`` / ``from … import``
statement counts wherever it stands -- at module level, inside a function, a class, a ``try`` -- so
a circle cannot be hidden by moving one of its imports into a function.  Only imports guarded by
``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) are left out: they never run.

Resolution of one statement in module ``M`` to edges ``M -> T`` (names are ``ktransformers.*``
module names; a package is named by its ``__init__``):

* ``import a.b.c`` -> ``a.b.c`` (the deepest module named; the parents that Python also imports
  on the way, ``a`` and ``a.b``, are not edges -- otherwise every module would point at its
  package's ``__init__`` and every package that re-exports would be a circle by itself);
* ``from X import n`` (``X`` absolute or relative, resolved against ``M``'s package) -> ``X.n``
  when that is a module of the package (a submodule imported by name), else ``X``;
* packages' ``__init__`` modules that re-export their submodules: the ``__init__``'s own edges to
  its children are kept (importing the package does run them).  A module importing a *name* from
  a package ``X`` (its own parent, or any other package of ours) whose ``__init__`` merely
  re-exports it (``from .sub import n`` / ``from .sub import n as alias`` in ``X/__init__.py``)
  gets the edge to the submodule that defines it, ``X.sub`` -- that module is what the import
  needs.  So ``from . import z`` in ``ktransformers.x.y`` is ``ktransformers.x.y -> ktransformers.x.z``
  and ``from ktransformers.x import Foo`` (re-exported from ``.z``) is ``… -> ktransformers.x.z``.
  A name *defined* in the ``__init__`` itself (a function, a constant) keeps the edge to the
  ``__init__``, and if that ``__init__`` imports the importer back, it is a real circle.
* dynamic imports (``importlib.import_module`` with a computed name, the top-level package's lazy
  ``__getattr__``) are not seen; they are what a deliberately late lookup looks like.

Imports of other packages (torch, fastapi, …) are ignored.  The test finds the strongly connected
components (Tarjan, iterative) and fails listing, for each component with more than one module, a
circle through it (module names in order) and the import statements (file:line) forming it.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PKG = "ktransformers"
ROOT = Path(__file__).resolve().parent.parent / PKG


def _modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is_package) for every .py under the package (packages: their __init__)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        # only modules reachable as ktransformers.* (every directory on the way is a package)
        if any(not (root.parent.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
            continue
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        stack.extend(ast.iter_child_nodes(node))


def _reexports(mods: dict[str, tuple[Path, bool]], trees: dict[str, ast.AST]) -> dict[str, dict[str, str]]:
    """package -> {name: submodule} for the names its __init__ binds by ``from .sub import name``
    at module level (the re-exports)."""
    out: dict[str, dict[str, str]] = {}
    for name, (_, is_pkg) in mods.items():
        if not is_pkg:
            continue
        table: dict[str, str] = {}
        for node in trees[name].body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                target = f"{name}.{node.module}"
                if target in mods:
                    for alias in node.names:
                        table[alias.asname or alias.name] = target
        out[name] = table
    return out


def _resolve_base(module: str, is_pkg: bool, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    package = module if is_pkg else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_graph(root: Path = ROOT) -> dict[str, dict[str, list[int]]]:
    """module -> {imported module: [line numbers]} for the package's own modules."""
    mods = _modules(root)
    trees = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, (path, _) in mods.items()}
    reexports = _reexports(mods, trees)

    def nearest(name: str) -> str | None:
        # ``import ktransformers.x.y`` where y is not a module of ours (an attribute): its deepest module
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, list[int]]] = {name: {} for name in mods}
    for name, (_, is_pkg) in mods.items():
        edges = graph[name]

        def add(target: str | None, line: int) -> None:
            if target and target != name and (target == PKG or target.startswith(PKG + ".")):
                lines = edges.setdefault(target, [])
                if line not in lines:
                    lines.append(line)

        for node in _imports(trees[name]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PKG or alias.name.startswith(PKG + "."):
                        add(nearest(alias.name), node.lineno)
                continue
            base = _resolve_base(name, is_pkg, node)
            if base is None or not (base == PKG or base.startswith(PKG + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:  # a submodule imported by name
                    add(sub, node.lineno)
                elif base in reexports and alias.name in reexports[base]:  # a package's re-export
                    add(reexports[base][alias.name], node.lineno)
                else:
                    add(nearest(base), node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in reverse topological order, members sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def _cycle(graph: dict[str, dict[str, list[int]]], comp: list[str]) -> list[str]:
    """The shortest circle through the component's first module (BFS inside the component)."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp  # unreachable for a component of two or more


def _describe(graph, comp: list[str]) -> str:
    mods = _modules()
    cycle = _cycle(graph, comp)
    lines = [" -> ".join(cycle)]
    if len(comp) > len(cycle) - 1:
        lines.append(f"  (component of {len(comp)}: {', '.join(comp)})")
    for a, b in zip(cycle, cycle[1:]):
        path = mods[a][0].relative_to(ROOT.parent)
        lines.append(f"  {path}:{','.join(map(str, graph[a][b]))} imports {b}")
    return "\n".join(lines)


def test_graph_sees_the_package():
    graph = import_graph()
    # sanity: the resolver finds edges it must find (module level, relative, package re-export)
    assert "ktransformers.optimize.inject" in graph["ktransformers.optimize"]
    assert "ktransformers.errors" in graph["ktransformers"]
    assert any(graph.values())


def test_no_import_circles():
    graph = import_graph()
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    circles.sort()
    assert not circles, "import circles among the package's modules:\n" + "\n".join(
        _describe(graph, c) for c in circles
    )


def test_resolver_rules(tmp_path):
    """The resolution rules of the module docstring, on a made-up package."""
    pkg = tmp_path / PKG
    (pkg / "x").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .errors import E\n")
    (pkg / "errors.py").write_text("E = 1\n")
    (pkg / "x" / "__init__.py").write_text("from .z import Foo\nfrom .y import Bar\n\ndef helper(): pass\n")
    (pkg / "x" / "z.py").write_text("Foo = 1\n")
    (pkg / "x" / "y.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import z\n"
        "from ktransformers.x import Foo\n"
        "if TYPE_CHECKING:\n    from .w import W\n"
        "def f():\n    import ktransformers.errors\n"
        "Bar = 2\n"
    )
    (pkg / "x" / "w.py").write_text("from ktransformers.x import helper\n")
    g = import_graph(pkg)
    assert set(g["ktransformers.x.y"]) == {"ktransformers.x.z", "ktransformers.errors"}
    assert set(g["ktransformers.x"]) == {"ktransformers.x.z", "ktransformers.x.y"}
    assert set(g["ktransformers.x.w"]) == {"ktransformers.x"}  # defined in the __init__ itself
    assert [c for c in strongly_connected(g) if len(c) > 1] == []
    (pkg / "x" / "z.py").write_text("def g():\n    from .w import helper\nFoo = 1\n")  # z -> w -> x -> z
    g = import_graph(pkg)
    # y -> z as well, so y joins the circle
    assert [c for c in strongly_connected(g) if len(c) > 1] == [
        ["ktransformers.x", "ktransformers.x.w", "ktransformers.x.y", "ktransformers.x.z"]
    ]
