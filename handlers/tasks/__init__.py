"""Task registry: one adapter class per task, like transformers' SUPPORTED_TASKS.

Lazy on purpose: a task module imports transformers' models and pipelines, and those import
``torch._dynamo``, which dies on an unusable compile-cache directory. The TorchServe handler imports this
package before it has checked that directory (handlers.rungs.compile_cache), so a task module is imported only
when ``check_task`` is asked for its class. The names and locations are handlers/config/task_facts.py's, which
config validates against without importing this package (the task modules import config).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from handlers.config.fields import did_you_mean
from handlers.config.task_facts import TASK_FACTS, TASK_NAMES, is_user_task
from handlers.errors import ConfigError
from handlers.tasks.base import Task

# task name -> "module:class" of its adapter
TASK_LOCATIONS: Mapping[str, str] = MappingProxyType({name: facts.location for name, facts in TASK_FACTS.items()})


def check_task(name: str, path: str = "task", import_dir: Path | None = None) -> type[Task]:
    """The task class for ``name`` (its module imported now): a built-in task, or ``module:Class``, a task of one's
    own, imported from ``import_dir`` (the archive's root, where ``--extra-files`` land); a ConfigError listing the
    valid names otherwise."""
    if is_user_task(name):
        return _user_task(name, path, import_dir)
    try:
        location = TASK_LOCATIONS[name]
    except KeyError:
        raise ConfigError(f"{path}: unknown task {name!r}{did_you_mean(name, TASK_NAMES)}; "
                          f"use one of: {', '.join(sorted(TASK_NAMES))}") from None
    module_name, _, class_name = location.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _user_task(name: str, path: str, import_dir: Path | None) -> type[Task]:
    module_name, _, class_name = name.partition(":")
    if import_dir is not None and str(import_dir) not in sys.path:
        sys.path.insert(0, str(import_dir))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot import {module_name} for the task {name!r} ({type(exc).__name__}: {exc});"
                          f" pack {module_name.replace('.', '/')}.py with --extra-files") from exc
    task_class = getattr(module, class_name, None)
    if not (isinstance(task_class, type) and issubclass(task_class, Task)):
        raise ConfigError(f"{path}: {name} is not a subclass of handlers.tasks.Task "
                          f"({'missing' if task_class is None else type(task_class).__name__})")
    if getattr(task_class, "__abstractmethods__", None):
        raise ConfigError(f"{path}: {name} does not implement {', '.join(sorted(task_class.__abstractmethods__))}")
    return task_class


__all__ = ["TASK_LOCATIONS", "TASK_NAMES", "Task", "check_task"]
