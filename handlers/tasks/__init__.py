"""Task registry: one adapter class per task, like transformers' SUPPORTED_TASKS.

Lazy on purpose: a task module imports transformers' models and pipelines, and those import
``torch._dynamo``, which dies on an unusable compile-cache directory. The TorchServe handler imports this
package before it has checked that directory (handlers.rungs.compile_cache), so a task module is imported only
when ``check_task`` is asked for its class. The names and locations are handlers/config/task_facts.py's, which
config validates against without importing this package (the task modules import config).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

from handlers.config.fields import did_you_mean
from handlers.config.task_facts import TASK_FACTS, TASK_NAMES
from handlers.errors import ConfigError
from handlers.tasks.base import Task

# task name -> "module:class" of its adapter
TASK_LOCATIONS: Mapping[str, str] = MappingProxyType({name: facts.location for name, facts in TASK_FACTS.items()})


def check_task(name: str, path: str = "task") -> type[Task]:
    """The adapter class for ``name`` (its module imported now); a ConfigError listing the valid names otherwise."""
    try:
        location = TASK_LOCATIONS[name]
    except KeyError:
        raise ConfigError(f"{path}: unknown task {name!r}{did_you_mean(name, TASK_NAMES)}; "
                          f"use one of: {', '.join(sorted(TASK_NAMES))}") from None
    module_name, _, class_name = location.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["TASK_LOCATIONS", "TASK_NAMES", "Task", "check_task"]
