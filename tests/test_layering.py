"""The package's floor plan and layering (docs/architecture.md, "Where the code is"), checked
on the import graph, imports inside functions counted too (an import moved into a function to
dodge a circle or a layer is still there):

- no import circles;
- at most 25 modules flat at the top of rudra_zmq/: the rest lives in its wing;
- the sync protocol is pure: sync/ imports nothing else of the package;
- the library below the roles (the modules at the top, sync/, security/, data/ but its server,
  results/) imports no role's wing, nor launch/, sim/ or benchmarks/;
- a role's wing imports another wing only where the floor plan says (ALLOWED below);
- nothing outside launch/ imports launch/ but the front doors, cli.py and api.py."""

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


MAX_TOP_MODULES = 25
FRONT_DOORS = {"rudra_zmq.cli", "rudra_zmq.api", "rudra_zmq.__main__"}
WINGS = ("server", "tree", "learner", "stats", "broadcast")  # one role each (broadcast: adv*)
ROLE_MODULES = {"rudra_zmq.data.server"}  # a role that lives beside what it serves
ABOVE = ("launch", "sim", "benchmarks")  # what starts, simulates or measures the roles
# wing -> the modules of other wings it may import, and why
ALLOWED = {
    "tree": {
        "rudra_zmq.server.serving",  # a node serves its children through the PS's request path
        "rudra_zmq.server.throttled_log",  # ... and warns about its peers as the PS does
    },
    "server": {
        "rudra_zmq.broadcast.root",  # Rudra-adv*: the root PS publishes into the broadcast
        "rudra_zmq.stats.client",  # every role reports to the statistics server
    },
    "learner": {
        "rudra_zmq.broadcast.member",  # Rudra-adv*: a learner is a member of the broadcast
        "rudra_zmq.stats.client",
        "rudra_zmq.server.end_files",  # restarted: finished servers' ranges, as they left them
    },
    "stats": {
        "rudra_zmq.server.end_files",  # the final weights as the PS left them
        "rudra_zmq.server.restart_record",  # the restarts each server listed (records lost)
        "rudra_zmq.server.journal",  # the λ changes each server kept (records lost)
        "rudra_zmq.server.throttled_log",  # it warns about its senders as the PS does
    },
    "data-server": {"rudra_zmq.server.throttled_log"},  # ... and so does the data server
    "broadcast": set(),
}


def _wing(module: str) -> str | None:
    """The wing (or the layer above the roles) ``module`` belongs to; None for the library."""
    if module in ROLE_MODULES:
        return "data-server"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in WINGS + ABOVE:
        return parts[1]
    return None


def test_at_most_25_modules_sit_flat_at_the_top_of_the_package():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top: {top}"


def test_the_sync_protocol_imports_nothing_else_of_the_package():
    graph = import_graph()
    outside = {
        (m, d)
        for m, deps in graph.items()
        if m.startswith("rudra_zmq.sync")
        for d in deps
        if not d.startswith("rudra_zmq.sync")
    }
    assert not outside, outside


def test_the_library_below_the_roles_imports_no_role_and_nothing_above_them():
    graph = import_graph()
    wrong = {
        (m, d)
        for m, deps in graph.items()
        if _wing(m) is None and m not in FRONT_DOORS
        for d in deps
        if _wing(d) is not None
    }
    assert not wrong, wrong


def test_a_role_imports_another_roles_wing_only_where_the_floor_plan_says():
    graph = import_graph()
    wrong = set()
    for m, deps in graph.items():
        wing = _wing(m)
        if wing is None or wing in ABOVE:
            continue
        for d in deps:
            other = _wing(d)
            if other is not None and other != wing and d not in ALLOWED.get(wing, set()):
                wrong.add((m, d))
    assert not wrong, wrong


def test_nothing_outside_launch_imports_launch_but_the_front_doors():
    graph = import_graph()
    wrong = {
        (m, d)
        for m, deps in graph.items()
        if not m.startswith("rudra_zmq.launch") and m not in FRONT_DOORS
        for d in deps
        if d.startswith("rudra_zmq.launch")
    }
    assert not wrong, wrong


def test_the_floor_plan_checks_catch_what_they_forbid():
    assert _wing("rudra_zmq.server.ps") == "server" and _wing("rudra_zmq.data.server") == (
        "data-server"
    )
    assert _wing("rudra_zmq.wire") is None and _wing("rudra_zmq.data.datasets") is None
    assert _wing("rudra_zmq.launch.launcher") == "launch"
    assert "rudra_zmq.learner.learner" not in ALLOWED["server"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
