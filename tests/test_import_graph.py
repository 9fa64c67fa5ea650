"""The imports of handlers/ form a tree from the entry points down, without a cycle, and go down the layers only.

Read from the source with ast, so an import inside a function counts: it runs as surely as one at the top, only
later (config used to import the task registry inside a function while every task module imports config). So
does the task registry's import by name of each module handlers/config/task_facts.py locates. Importing ``a.b.c``
also runs the package ``a.b``, unless the importer is inside it; only ``if TYPE_CHECKING:`` imports never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from handlers import LAYERS
from handlers.config.task_facts import TASK_FACTS

REPO = Path(__file__).resolve().parent.parent
ENTRY_POINTS = ("handlers.serving.torchserve_handler", "handlers.__main__")  # TorchServe's adapter, and the CLI
TORCHSERVE_ADAPTER = "handlers.serving.torchserve_handler"
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
    # Importing an entry point runs the packages on the way to it too (handlers.serving for the adapter).
    packages = tuple(entry.rsplit(".", level)[0] for entry in ENTRY_POINTS for level in range(1, entry.count(".")))
    assert reachable(graph, ENTRY_POINTS + packages) == set(graph) - {"handlers"}


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


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of the layer holding ``module`` (None for the package itself and its CLI, above all)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_of_the_package_sits_in_a_layer():
    unplaced = {name for name in import_graph() if layer_of(name) is None} - {"handlers", "handlers.__main__"}
    assert not unplaced, f"modules outside the layers of handlers.LAYERS: {sorted(unplaced)}"


def test_imports_go_down_the_layers_only():
    upward = sorted(f"{name} ({LAYERS[layer_of(name)]}) imports {target} ({LAYERS[layer_of(target)]})"
                    for name, targets in import_graph().items() if layer_of(name) is not None
                    for target in targets if layer_of(target) is not None and layer_of(target) > layer_of(name))
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_an_upward_import_is_found():
    """The check itself: config importing a task module would be an import up the layers."""
    assert layer_of("handlers.config.settings") < layer_of("handlers.tasks.embeddings")
    assert layer_of("handlers.errors") == 0 and layer_of("handlers") is None


def test_only_the_torchserve_adapter_imports_torchserve():
    importers = sorted(str(path.relative_to(REPO)) for path in (REPO / "handlers").rglob("*.py")
                       if module_name(path) != TORCHSERVE_ADAPTER and _imports_ts(path))
    assert not importers, f"TorchServe (ts) imported outside {TORCHSERVE_ADAPTER}: {importers}"
    assert _imports_ts(REPO / (TORCHSERVE_ADAPTER.replace(".", "/") + ".py"))


def _imports_ts(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(name == "ts" or name.startswith("ts.") for name in names):
            return True
    return False
