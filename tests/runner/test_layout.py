"""runner/'s import graph has no circle: every module's imports (top-level and inside functions, but not
`if TYPE_CHECKING:` blocks) form a DAG, so each concern sits above or below the others, never both.

The graph is read from the source with `ast`, not by importing: a lazy import inside a function is an
edge too (the old circle, runner/layers -> the CPU graph runner -> runner/layers, was made of lazy
imports only). A package's own __init__ running before its submodules is not counted as an edge:
that is Python's loading order, not a dependency the code chose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "runner"


def _module_names() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The runner modules `module` imports, skipping `if TYPE_CHECKING:` bodies."""
    found: set[str] = set()

    def target(name: str) -> str | None:
        # The longest runner module that `name` names (an attribute import resolves to its module).
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(target(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else target(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(None)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = _module_names()
    names = set(paths)
    return {m: _imports(ast.parse(p.read_text(), str(p)), m, p.name == "__init__.py", names) for m, p in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def test_runner_import_graph_is_acyclic():
    """No runner module imports (directly or through others) a module that imports it back."""
    graph = import_graph()
    assert "runner.model_runner" in graph and graph["runner.model_runner"], "the graph reader found no imports"
    assert find_cycle(graph) is None, f"import circle in runner/: {' -> '.join(find_cycle(graph))}"


@pytest.mark.parametrize("source, expect_cycle", [
    ({"runner.a": "def f():\n    from runner.b import x\n", "runner.b": "from runner import a\n"}, True),
    ({"runner.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runner.b import x\n",
      "runner.b": "import runner.a\n"}, False),
    ({"runner.a": "from runner.b import x\n", "runner.b": "import torch\n"}, False),
])
def test_cycle_finder_sees_lazy_imports_and_skips_type_checking(source, expect_cycle):
    """The checker flags a circle made of a function-level import and ignores TYPE_CHECKING-only edges."""
    names = set(source) | {"runner"}
    graph = {m: _imports(ast.parse(src), m, False, names) for m, src in source.items()}
    assert (find_cycle(graph) is not None) == expect_cycle
