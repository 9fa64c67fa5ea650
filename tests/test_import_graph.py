"""The imports of handlers/ form a tree from the entry points down, without a cycle (issue 20, item 4).

Read from the source with ast, so an import inside a function counts: it runs as surely as one at the top, only
later (config used to import the task registry inside a function while every task module imports config). So
does the task registry's import by name of each module handlers/task_catalog.py locates. Importing ``a.b.c``
also runs the package ``a.b``, unless the importer is inside it; only ``if TYPE_CHECKING:`` imports never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from handlers.task_catalog import TASK_FACTS

REPO = Path(__file__).resolve().parent.parent
ENTRY_POINTS = ("handlers.torchserve_handler", "handlers.__main__")  # TorchServe's adapter, and the CLI
REGISTRY = "handlers.tasks"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each handlers module -> the handlers modules (and packages) importing it runs."""
    paths = {module_name(path): path for path in sorted((REPO / "handlers").rglob("*.py"))}
    graph = {name: _imports(name, path, set(paths)) for name, path in paths.items()}
    graph[REGISTRY] |= {facts.location.partition(":")[0] for facts in TASK_FACTS.values()}
    return graph


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    targets: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _running_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, up level - 1
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)  # `from handlers import engine`
    edges = set()
    for target in targets:
        parts = target.split(".")
        for end in range(1, len(parts) + 1):  # the module itself and every package on the way to it
            prefix = ".".join(parts[:end])
            if prefix in modules and prefix != name and not name.startswith(f"{prefix}."):
                edges.add(prefix)
    return edges


def _running_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                pending.extend(child.orelse)
            else:
                pending.append(child)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the modules along it (first == last), or None: a depth-first walk."""
    done: set[str] = set()
    for root in sorted(set(graph) - done):
        path, children = [root], [iter(sorted(graph[root]))]
        while children:
            child = next(children[-1], None)
            if child is None:
                children.pop()
                done.add(path.pop())
            elif child in path:
                return path[path.index(child):] + [child]
            elif child not in done:
                path.append(child)
                children.append(iter(sorted(graph.get(child, ()))))
    return None


def reachable(graph: dict[str, set[str]], roots: tuple[str, ...]) -> set[str]:
    seen, pending = set(roots), list(roots)
    while pending:
        for child in graph[pending.pop()] - seen:
            seen.add(child)
            pending.append(child)
    return seen


def test_the_import_graph_of_handlers_has_no_cycle():
    graph = import_graph()
    assert {"handlers.config", "handlers.tasks.base", REGISTRY} <= set(graph)  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_hangs_below_an_entry_point():
    graph = import_graph()
    assert reachable(graph, ENTRY_POINTS) == set(graph) - {"handlers"}


def test_config_imports_no_task_module_and_no_registry():
    below_config = reachable(import_graph(), ("handlers.config",))
    assert not {name for name in below_config if name.startswith(REGISTRY)}, below_config


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    """The detector itself: config importing the registry inside a function, as it once did."""
    graph = {"handlers.config": {REGISTRY}, REGISTRY: {"handlers.tasks.base"},
             "handlers.tasks.base": {"handlers.config"}}
    assert find_cycle(graph) == ["handlers.config", REGISTRY, "handlers.tasks.base", "handlers.config"]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from handlers.tasks import check_task\n")
    assert _imports("handlers.config", source, {"handlers.tasks", "handlers.config"}) == {REGISTRY}
