"""Typed errors, each carrying the HTTP status a client should see.

The TorchServe adapter maps these to responses in one place; nothing else decides a status.
"""

from __future__ import annotations

from collections.abc import Sequence


class HandlerError(Exception):
    """Base class. ``status`` is the HTTP status; ``message`` is safe to show a client."""

    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict:
        return {"code": self.status, "type": type(self).__name__, "message": self.message}


class ConfigError(HandlerError, ValueError):
    """The model YAML is invalid. Raised at load time, so the worker never becomes READY (500). ``problems``: one
    line each, all of them (``message`` joins them)."""

    status = 500

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = tuple(problems) or (message,)


class ModelLoadError(HandlerError):
    """The model directory cannot be loaded (missing files, no safetensors) (500)."""

    status = 500


class InvalidInput(HandlerError, ValueError):
    """The request body is malformed or out of bounds (400). Only that request fails."""

    status = 400


class PathNotFound(HandlerError):
    """A request to a path under the model's URL that its task does not answer (404). Only that request fails."""

    status = 404


class ModelNotReady(HandlerError):
    """A request arrived before the model finished loading, or after it failed to (503)."""

    status = 503


class InferenceError(HandlerError):
    """The server failed, not the client: both the optimized and the eager forward failed on a batch, or reading
    one request hit a bug (500). The message names no internals; the log has them."""

    status = 500


def native_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust extension's panic (the tokenizers library's) as pyo3 raises it: ``PanicException``,
    a BaseException that ``except Exception`` lets through, though it concerns the one input that caused it and the
    library works on after it. The serving path treats it as that input's failure."""
    return type(exc).__name__ == "PanicException" and not isinstance(exc, Exception)
