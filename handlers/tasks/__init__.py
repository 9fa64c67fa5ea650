"""Task registry: one adapter class per task, like transformers' SUPPORTED_TASKS."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from handlers.config import did_you_mean
from handlers.errors import ConfigError
from handlers.tasks.base import Task
from handlers.tasks.classification import TextClassificationTask
from handlers.tasks.embeddings import EmbeddingsTask
from handlers.tasks.generation import TextGenerationTask
from handlers.tasks.question_answering import QuestionAnsweringTask
from handlers.tasks.token_classification import TokenClassificationTask

TASKS: Mapping[str, type[Task]] = MappingProxyType({
    task.name: task for task in (
        EmbeddingsTask, TextClassificationTask, TokenClassificationTask, QuestionAnsweringTask,
        TextGenerationTask)
})


def check_task(name: str, path: str = "task") -> type[Task]:
    """The adapter class for ``name``; a ConfigError listing the valid names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"{path}: unknown task {name!r}{did_you_mean(name, TASKS)}; "
                          f"use one of: {', '.join(sorted(TASKS))}") from None


__all__ = ["TASKS", "Task", "check_task"]
