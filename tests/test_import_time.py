"""Nothing heavy at import of the handler module.

TorchServe imports the handler file before Pt2Handler.initialize checks the compile-cache location
(handlers.rungs.compile_cache). Anything that imports ``torch._dynamo`` at that point (transformers' pipelines do)
makes torch create TORCHINDUCTOR_CACHE_DIR first; an unusable one kills the worker at import, and TorchServe
restarts it forever. So the import must load no dynamo, no inductor, no pipelines and no task module, and a
worker of every task must come up READY on a private cache when the location is unusable, named either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from handlers.rungs.compile_cache import CONFIG_KEY, ENV_VAR
from handlers.serving import archive as package
from handlers.serving import server as tsctl
from tests.conftest import port_shift
from tests.test_torchserve import describe

REPO = Path(__file__).resolve().parent.parent

HEAVY_PREFIXES = ("torch._dynamo", "torch._inductor", "transformers.pipelines")
PRIVATE_PREFIX = "pt2-handlers-inductor-"  # compile_cache's private fallback directory
PORT_SHIFT = port_shift(15000)  # clear of the other test servers (+10000 ... +14000)

# The two ways a location is unusable, and what creating a directory there raises.
A_FILE = "a regular file"
UNDER_A_FILE = "a path under a regular file"
ERRORS = {A_FILE: "FileExistsError", UNDER_A_FILE: "NotADirectoryError"}


def unusable_location(root: Path, kind: str) -> Path:
    blocker = root / "blocker"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the compile cache should be\n")
    return blocker if kind == A_FILE else blocker / "inductor"


IMPORT_THEN_PREPARE = f"""
import json, os, sys

def loaded():
    from handlers.tasks import TASK_LOCATIONS
    tasks = tuple(location.partition(":")[0] for location in TASK_LOCATIONS.values())
    return sorted(name for name in sys.modules if name.startswith({HEAVY_PREFIXES!r}) or name in tasks)

import handlers.serving.engine
after_engine = loaded()
import handlers.serving.torchserve_handler
after_handler = loaded()
from handlers.rungs import compile_cache
cache = compile_cache.prepare(None)
import torch._dynamo
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(json.dumps({{"after_engine": after_engine, "after_handler": after_handler, "source": cache.source,
                  "chosen": cache.path, "env": os.environ[{ENV_VAR!r}], "inductor_dir": cache_dir()}}))
"""


@pytest.mark.parametrize("kind", [A_FILE, UNDER_A_FILE])
def test_the_handler_imports_nothing_heavy_and_dynamo_imports_after_the_cache_check(tmp_path, kind):
    location = unusable_location(tmp_path, kind)
    env = {**os.environ, ENV_VAR: str(location), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", IMPORT_THEN_PREPARE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_engine"] == [] and seen["after_handler"] == [], seen
    assert seen["source"] == "private fallback"
    assert Path(seen["chosen"]).name.startswith(PRIVATE_PREFIX) and Path(seen["chosen"]).parent == tmp_path
    assert seen["env"] == seen["inductor_dir"] == seen["chosen"]


def test_every_registered_task_imports_on_demand_under_its_own_name():
    from handlers.errors import ConfigError
    from handlers.tasks import TASK_NAMES, check_task

    assert {check_task(name).name for name in TASK_NAMES} == set(TASK_NAMES)
    with pytest.raises(ConfigError, match=r"unknown task 'embedding' \(did you mean embeddings\?\); use one of"):
        check_task("embedding")


# task -> (model: a task_model_dirs name, None for MiniLM itself; the shipped model YAML; the archive's short name)
TASK_ARCHIVES = {
    "embeddings": (None, "minilm-embeddings.yaml", "embeddings"),
    "text-classification": ("minilm-sentiment", "minilm-text-classification.yaml", "sentiment"),
    "token-classification": ("minilm-ner", "minilm-token-classification.yaml", "ner"),
    "question-answering": ("minilm-qa", "minilm-question-answering.yaml", "qa"),
    "text-generation": ("tiny-llama", "tiny-llama-generation.yaml", "llama"),
}
# One server per kind of unusable TORCHINDUCTOR_CACHE_DIR. Every task is served once through the environment
# and once with the location in its YAML (the other kind, so the warning proves the YAML's location was used).
SERVERS = {
    A_FILE: {"env": ("embeddings", "text-classification", "token-classification"),
             "yaml": ("question-answering", "text-generation")},
    UNDER_A_FILE: {"env": ("question-answering", "text-generation"),
                   "yaml": ("embeddings", "text-classification", "token-classification")},
}


def eager_config(task: str, out: Path, compile_cache: Path | None) -> Path:
    """The shipped model YAML of ``task``, made cheap: the crash came at import, before any rung, so compiling and
    a long warmup would only cost time (five workers load at once on this test's two cores). With
    ``pt2_handlers.compile_cache`` if given."""
    config = yaml.safe_load((REPO / "model_configs" / TASK_ARCHIVES[task][1]).read_text())
    settings = config["pt2_handlers"]
    settings["ladder"] = ["eager"]
    settings["threads"] = 1  # "auto" gives each of the five workers every core
    if settings["shapes"]["policy"] == "dynamic":  # the fewest warmup shapes the dynamic policy accepts
        settings["shapes"].update(batch_sizes=[1, 2], seq_lengths=[16])
    if compile_cache is not None:
        settings[CONFIG_KEY] = str(compile_cache)
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


@pytest.mark.integration
@pytest.mark.ipex_stage  # once, in the ipex stage when scripts/test.sh runs one (see tests/conftest.py)
@pytest.mark.parametrize("env_kind", list(SERVERS))
def test_every_task_comes_up_on_a_private_cache_when_the_location_is_unusable(tmp_path, env_kind, minilm_dir,
                                                                               task_model_dirs):
    yaml_kind = UNDER_A_FILE if env_kind == A_FILE else A_FILE
    env_location = unusable_location(tmp_path / "env", env_kind)
    yaml_location = unusable_location(tmp_path / "yaml", yaml_kind)
    store = tmp_path / "store"
    expected = {}  # archive name -> (task, the warning's start)
    for way, location, kind in (("env", env_location, env_kind), ("yaml", yaml_location, yaml_kind)):
        for task in SERVERS[env_kind][way]:
            model, _, short = TASK_ARCHIVES[task]
            name = f"{way}-{short}"
            config = eager_config(task, tmp_path / f"{name}.yaml", location if way == "yaml" else None)
            # A directory, not a zip: the same files, without compressing and unpacking 90 MB ten times.
            package.build(name, task_model_dirs[model] if model else minilm_dir, config, store,
                          archive_format="no-archive")
            source = f"pt2_handlers.{CONFIG_KEY}" if way == "yaml" else ENV_VAR
            expected[name] = (task, f"{source} {location} is unusable ({ERRORS[kind]}")
    started = time.monotonic()
    # A worker that crash-loops at import makes tsctl.start fail with the worker's error after 3 deaths.
    server = tsctl.start(tsctl.shifted_config(tmp_path, PORT_SHIFT), store, [f"{name}={name}" for name in expected],
                         tmp_path / "run", timeout=300, extra_env={ENV_VAR: str(env_location)})
    print(f"{len(expected)} workers READY in {time.monotonic() - started:.0f}s")
    try:
        for name, (task, warning) in expected.items():
            described = describe(server, name)["customizedMetadata"]
            cache = described["optimization"]["compile_cache"]
            assert (described["state"], described["task"], described["optimization"]["active"]) == (
                "ready", task, "eager"), (name, described)
            assert cache["source"] == "private fallback", (name, cache)
            assert cache["warning"].startswith(warning) and "starts cold" in cache["warning"], (name, cache)
            private = Path(cache["dir"])
            assert private.name.startswith(PRIVATE_PREFIX) and private.parent == server.run_dir / "tmp", (name, cache)
    finally:
        tsctl.stop(server.run_dir)
