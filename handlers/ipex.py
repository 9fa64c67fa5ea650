"""Lazy probe for intel-extension-for-pytorch (IPEX).

IPEX is imported only when its rung is tried, never at module import. A wheel built for another torch
fails in more ways than ImportError (IPEX 2.8 on torch 2.13 raises AttributeError; some builds exit), so
every failure becomes a reason string and the ladder moves on.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

IPEX_MODULE = "intel_extension_for_pytorch"


def probe_ipex() -> tuple[ModuleType | None, str | None]:
    """Return ``(module, None)`` when IPEX imports cleanly, else ``(None, reason)``."""
    if importlib.util.find_spec(IPEX_MODULE) is None:
        return None, f"{IPEX_MODULE} is not installed (pip install 'pt2-handlers[ipex]' in a torch 2.8 venv)"
    try:
        return importlib.import_module(IPEX_MODULE), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- any failure means: no IPEX here
        import torch

        return None, f"{IPEX_MODULE} failed to import with torch {torch.__version__}: {type(exc).__name__}: {exc}"
