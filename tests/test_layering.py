"""The package's layering: no import circles, counting imports inside functions too (an
import moved into a function to dodge a circle is still a circle)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rudra_zmq"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (
                    (f"{base}.{node.module}" if node.module else base)
                    if node.level
                    else node.module or ""
                )
                for alias in node.names:  # `from . import x` may name a module
                    full = f"{target}.{alias.name}"
                    deps.add(full if full in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        # a module's own packages are initialised before it: importing them is no circle
        graph[name] = {d for d in deps if d in modules and not (name + ".").startswith(d + ".")}
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_package_has_no_import_circles():
    graph = import_graph()
    assert "rudra_zmq.sync" in graph and "rudra_zmq.config" in graph["rudra_zmq.cli"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
