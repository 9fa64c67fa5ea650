"""Where inductor keeps what it compiled, so a restarted or added worker (or a new host that mounts the
same volume) loads warm instead of compiling again.

One question, answered once per worker before anything imports ``torch._dynamo``: where may this worker
write? Candidates, in order: ``pt2_handlers.compile_cache`` from the model YAML, ``TORCHINDUCTOR_CACHE_DIR``
from the environment, torch's default (``$TMPDIR/torchinductor_$USER``). A candidate that cannot be created
or written is replaced by a private directory, with a warning, because torch would otherwise die while
importing dynamo and TorchServe would restart the worker forever. If not even a private directory can be
made, compiling is skipped with the reason. This is the only module that sets the environment variable.
"""

from __future__ import annotations

import getpass
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"
CONFIG_KEY = "compile_cache"


@dataclass(frozen=True)
class CacheDir:
    path: str | None  # None: nowhere to compile into
    source: str
    warning: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"dir": self.path, "source": self.source, "warning": self.warning}


def configured_dir(raw_yaml: Any) -> str | None:
    """``pt2_handlers.compile_cache`` read leniently (load_config reports a wrong type); needed before the
    config is validated, because validating it imports torch._dynamo."""
    settings = raw_yaml.get("pt2_handlers") if isinstance(raw_yaml, Mapping) else None
    value = settings.get(CONFIG_KEY) if isinstance(settings, Mapping) else None
    return value if isinstance(value, str) else None


def prepare(configured: str | None, environ: dict[str, str] | None = None) -> CacheDir:
    """Choose a writable cache directory and export it for inductor; never raises."""
    environ = os.environ if environ is None else environ
    choice = choose(configured, environ)
    if choice.warning:
        logger.warning("compile cache: %s", choice.warning)
    if choice.path is not None:
        environ[ENV_VAR] = choice.path
        if "torch._inductor.utils" in sys.modules:  # inductor memoizes paths under the old directory
            import torch._inductor.utils

            torch._inductor.utils.clear_caches()
        logger.info("compile cache: %s (%s)", choice.path, choice.source)
    return choice


def choose(configured: str | None, environ: Mapping[str, str]) -> CacheDir:
    if configured:
        candidate, source = configured, f"pt2_handlers.{CONFIG_KEY}"
    elif environ.get(ENV_VAR):
        candidate, source = environ[ENV_VAR], ENV_VAR
    else:
        candidate, source = _torch_default(), "torch default"
    path = os.path.abspath(os.path.expanduser(candidate))
    problem = unusable_reason(path)
    if problem is None:
        return CacheDir(path, source)
    try:
        private = tempfile.mkdtemp(prefix="pt2-handlers-inductor-")
    except OSError as exc:
        return CacheDir(None, "none", f"{source} {path} is unusable ({problem}) and no private directory could be "
                                      f"made ({exc}); compiling is skipped")
    return CacheDir(private, "private fallback",
                    f"{source} {path} is unusable ({problem}); this worker compiles into {private} and starts cold")


def unusable_reason(path: str) -> str | None:
    """None if ``path`` is (or can be made) a directory this process can write files into."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pt2-handlers-probe-"):
            pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def _torch_default() -> str:
    # torch's own default (torch._inductor.runtime.cache_dir_utils), which cannot be imported without dynamo.
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


# torch's own counters of what its caches served: (counter group, key prefix) per cache.
CACHES = {"fx_graph": ("inductor", "fxgraph_cache"), "aot_autograd": ("aot_autograd", "autograd_cache")}
OUTCOMES = ("hit", "miss", "bypass")


def use_counters() -> dict[str, dict[str, int]]:
    """How often each compile cache hit, missed or was bypassed in this process so far."""
    from torch._dynamo.utils import counters

    return {cache: {outcome: int(counters[group][f"{prefix}_{outcome}"]) for outcome in OUTCOMES}
            for cache, (group, prefix) in CACHES.items()}


def use_since(before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What the caches served since ``before`` (a ``use_counters()``): e.g. a warm worker's load shows hits
    and no misses."""
    now = use_counters()
    return {cache: {outcome: now[cache][outcome] - before[cache][outcome] for outcome in OUTCOMES} for cache in now}
