"""Manage models on a running TorchServe through its management API, with the key read from key_file.json.

  python -m handlers list
  python -m handlers register minilm.mar [--name minilm] [--workers 1]
  python -m handlers scale minilm --min 1 --max 3 [--wait]
  python -m handlers describe minilm [--json]    # the ladder, rung attempts, workers
  python -m handlers default minilm 2.0          # the version /predictions/minilm serves
  python -m handlers unregister minilm [--version 1.0]
  python -m handlers ready minilm                # exit 0 once a worker is READY (a k8s probe)

--config and --run-dir name the server, before or after the command (default: the one ``python -m handlers start``
started from the current directory). A failing call exits 1 and prints TorchServe's error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from urllib.parse import quote, urlencode

from handlers.serving.server import Server, add_server_options, server_for, wait_ready, worker_status


class ManagementError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def call(server: Server, method: str, path: str, timeout: float = 120) -> Any:
    status, body = server.management(method, path, timeout=timeout)
    if status >= 400:
        raise ManagementError(f"{method} {path}: {status} {body.decode(errors='replace').strip()}", status)
    return json.loads(body) if body.strip() else None


# TorchServe 0.12 answers a synchronous management call (synchronous=true) on a network thread that inference
# connections share: until the new workers are READY (a compile: tens of seconds), every client whose new connection
# lands on that thread waits, on every model. So this CLI always asks asynchronously and waits by asking describe.


def register(server: Server, archive: str, name: str | None = None, workers: int = 1,
             timeout: float = 900) -> Any:
    query = {"url": archive, "initial_workers": workers, "synchronous": "false"}
    if name:
        query["model_name"] = name
    answer = call(server, "POST", f"/models?{urlencode(query)}", timeout=timeout)
    if not name:  # the archive's own name, from its manifest: TorchServe lists it beside the URL it came from
        models = call(server, "GET", "/models?limit=10000")["models"]
        name = next((model["modelName"] for model in models if model["modelUrl"] == archive), None)
        if name is None:
            raise ManagementError(f"registered {archive}, but TorchServe lists no model from it; pass --name to wait")
    wait_ready(server, name, timeout, count=workers)
    return answer


# TorchServe 0.12's frontend can answer a scale request with this 500 when a worker changes state while it edits
# the worker list (seen scaling 3 -> 1 under traffic). Scaling sets min/max, so asking again is safe.
FRONTEND_RACE = "ConcurrentModificationException"
SCALE_ATTEMPTS = 3


def scale(server: Server, name: str, min_workers: int, max_workers: int, wait: bool = False,
          timeout: float = 900, retry_pause: float = 0.5) -> Any:
    query = urlencode({"min_worker": min_workers, "max_worker": max_workers, "synchronous": "false"})
    for attempt in range(1, SCALE_ATTEMPTS + 1):
        try:
            answer = call(server, "PUT", f"/models/{quote(name)}?{query}", timeout=timeout)
            break
        except ManagementError as exc:
            if FRONTEND_RACE not in str(exc) or attempt == SCALE_ATTEMPTS:
                raise
            print(f"scale {name}: TorchServe answered {FRONTEND_RACE} (a race in its frontend); "
                  f"asking again ({attempt + 1}/{SCALE_ATTEMPTS})", file=sys.stderr)
            time.sleep(retry_pause)
    if wait:
        wait_ready(server, name, timeout, count=min_workers)
    return answer


def ready(server: Server, name: str) -> str:
    """What a readiness probe needs: the model has a READY worker (its ladder ran and a rung was proven). Not the
    customized describe: that one asks a worker, which may be busy with a batch."""
    entries = call(server, "GET", f"/models/{quote(name)}", timeout=5)
    workers = [worker for entry in entries for worker in entry.get("workers", [])]
    count = sum(worker.get("status") == "READY" for worker in workers)
    summary = f"{name}: {count}/{len(workers)} workers READY"
    if not count:
        raise ManagementError(summary)
    return summary


def describe(server: Server, name: str, worker_timeout: float = 20) -> list[dict[str, Any]]:
    """TorchServe's describe with our metadata, which only a worker can give (``customized=true``). Asked only while
    a worker is READY, for at most ``worker_timeout`` seconds: TorchServe holds the question until a worker takes it (a
    loading one: minutes) and answers 507 for one that died meanwhile, as in a restart. Then the plain describe, the
    workers as TorchServe lists them, with a note on stderr; any other error is raised."""
    plain = call(server, "GET", f"/models/{quote(name)}")
    if not any(worker.get("status") == "READY" for entry in plain for worker in entry.get("workers", [])):
        return plain
    try:
        return call(server, "GET", f"/models/{quote(name)}?customized=true", timeout=worker_timeout)
    except ManagementError as exc:
        if exc.status != 507:
            raise
        reason = f"the worker asked died meanwhile ({exc})"
    except OSError as exc:  # the socket's timeout: no worker took the question in time
        reason = f"no worker answered within {worker_timeout:g}s ({exc})"
    print(f"no pt2-handlers metadata: {reason}; the workers as TorchServe lists them:", file=sys.stderr)
    return plain


def format_description(entries: list[dict[str, Any]]) -> str:
    """TorchServe's describe with pt2-handlers' metadata, for a person: per version, its workers, the ladder's
    attempts and what serves now."""
    lines = []
    for entry in entries:
        meta = entry.get("customizedMetadata") or {}
        if isinstance(meta, str):
            meta = json.loads(meta)
        default = " (default)" if entry.get("defaultVersion") else ""
        lines.append(f"{entry['modelName']} {entry['modelVersion']}{default}: task {meta.get('task', '?')}, "
                     f"state {meta.get('state', '?')}, batchSize {entry.get('batchSize')}, "
                     f"maxBatchDelay {entry.get('maxBatchDelay')} ms, workers {entry.get('minWorkers')}.."
                     f"{entry.get('maxWorkers')}")
        for worker in entry.get("workers", []):
            lines.append(f"  worker {worker['id']}: pid {worker['pid']} {worker_status(worker)}")
        lines += _optimization_lines(meta.get("optimization") or {}, meta.get("outputs") or {})
        if meta.get("failure"):
            lines.append(f"  failure: {meta['failure']}")
    return "\n".join(lines)


def _optimization_lines(optimization: dict[str, Any], outputs: dict[str, Any]) -> list[str]:
    if not optimization:
        return ["  (no pt2-handlers metadata: no worker answered for it -- loading, restarting or busy -- or not a "
                "pt2-handlers model)"]
    lines = [f"  serving: rung {optimization.get('active')} in {optimization.get('dtype')} on "
             f"{optimization.get('device')} ({optimization.get('dtype_reason')}), "
             f"{optimization.get('threads', {}).get('intra_op')} threads"]
    for attempt in optimization.get("attempts", []):
        quality = attempt.get("quality") or {}
        gate = (f", {quality['metric']} {quality['value']:.6g} (needs >= {quality['threshold']:.6g})"
                if "value" in quality else "")
        reason = f": {attempt['reason']}" if attempt.get("reason") else ""
        rung = f"{attempt['rung']} (screen)" if attempt.get("screen") else attempt["rung"]
        lines.append(f"    {rung:<15} {attempt.get('dtype') or '':<9} {attempt['status']:<9} "
                     f"{attempt.get('seconds', 0):7.1f}s{gate}{reason}")
    pooled = outputs.get("pooling")
    if pooled:
        lines.append(f"  answers: pooling {'+'.join(pooled['modes'])}, "
                     f"{'L2-normalised' if pooled['normalize'] else 'not normalised'} ({pooled['from']})")
    runtime = optimization.get("runtime") or {}
    if runtime:
        lines.append(f"  after READY: {runtime.get('runtime_failures')} fallbacks (demote after "
                     f"{runtime.get('max_runtime_failures')}{', DEMOTED' if runtime.get('demoted') else ''}), "
                     f"{runtime.get('compiles_after_ready')} compiles, {runtime.get('eager_batches')} eager batches, "
                     f"{runtime.get('frames_given_up', 0)} frames dynamo gave up on "
                     f"(stance {runtime.get('after_ready')})")
    cache = optimization.get("compile_cache") or {}
    if cache:
        use = ", ".join(f"{name} {counts['hit']} hit / {counts['miss']} missed"
                        for name, counts in (cache.get("use_at_load") or {}).items())
        lines.append(f"  compile cache: {cache.get('dir')} ({cache.get('source')}){'; at load: ' + use if use else ''}"
                     f"{'; ' + cache['warning'] if cache.get('warning') else ''}")
    lines += [f"  note: {note}" for note in optimization.get("notes", [])]
    return lines


def add_commands(commands: argparse._SubParsersAction) -> None:
    """The management commands, each at the top level of ``python -m handlers``."""

    def command(name: str, says: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=says)
        add_server_options(parser, in_command=True)
        parser.set_defaults(run=run)
        return parser

    command("list", "registered models")
    p = command("register", "register an archive from the model store (waits until READY)")
    p.add_argument("archive", help="a .mar in the server's model store, e.g. minilm.mar")
    p.add_argument("--name")
    p.add_argument("--workers", type=int, default=1)
    p = command("scale", "set min/max workers")
    p.add_argument("name")
    p.add_argument("--min", type=int, required=True, dest="min_workers")
    p.add_argument("--max", type=int, required=True, dest="max_workers")
    p.add_argument("--wait", action="store_true", help="wait until --min workers are READY")
    p = command("describe", "workers and the optimization ladder")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p = command("default", "set the version /predictions/NAME serves")
    p.add_argument("name")
    p.add_argument("version")
    p = command("unregister", "unregister a model, or one version of it")
    p.add_argument("name")
    p.add_argument("--version")
    p = command("ready", "exit 0 if the model has a READY worker, 1 otherwise (a readiness probe)")
    p.add_argument("name")


def run(args: argparse.Namespace) -> int:
    server = server_for(args.server_config, args.run_dir.resolve())
    try:
        if args.command == "ready":
            print(ready(server, args.name))
            return 0
        if args.command == "describe":
            entries = describe(server, args.name)
            print(json.dumps(entries, indent=2) if args.json else format_description(entries))
            return 0
        answer = {
            "list": lambda: call(server, "GET", "/models"),
            "register": lambda: register(server, args.archive, args.name, args.workers),
            "scale": lambda: scale(server, args.name, args.min_workers, args.max_workers, args.wait),
            "default": lambda: call(server, "PUT", f"/models/{quote(args.name)}/{quote(args.version)}/set-default"),
            "unregister": lambda: call(server, "DELETE", f"/models/{quote(args.name)}"
                                       + (f"/{quote(args.version)}" if args.version else "")),
        }[args.command]()
    except (ManagementError, OSError) as exc:  # OSError: the server is not (yet) listening
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0
