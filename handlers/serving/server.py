"""Start, wait for and stop a TorchServe for pt2-handlers, with token auth on: ``python -m handlers start|stop``.

``start`` runs ``torchserve --start`` inside a run directory (key_file.json, logs/ and the pid file
land there, so several servers never share state), waits until every model has a READY worker, then
prints how to call it. It never prints a key: the commands it shows read the key from the file.

The defaults are relative to the current directory, the project's root: model_configs/config.properties,
model_store/ and .run/. Used by ``python -m handlers`` (and scripts/start.sh, scripts/stop.sh, scripts/run.sh),
the management commands (handlers/serving/management.py), the benchmarks and the integration tests. It runs the
``torchserve`` command beside this Python; it never imports TorchServe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib import error, request

DEFAULT_RUN_DIR = Path(".run")
DEFAULT_CONFIG = Path("model_configs") / "config.properties"
DEFAULT_MODEL_STORE = Path("model_store")
DEFAULT_CACHE_DIR = Path(".cache") / "inductor"  # the compile cache a started server's workers share
DEFAULT_MODELS = ("minilm=minilm.mar",)


@dataclass(frozen=True)
class Server:
    run_dir: Path
    inference_url: str
    management_url: str
    metrics_url: str
    token_auth: bool = True  # False where the config sets disable_token_authorization=true (deploy/k8s: a proxy checks)

    @property
    def key_file(self) -> Path:
        return self.run_dir / "key_file.json"

    def key(self, kind: str) -> str | None:
        """``kind``: "inference" or "management"; None where the server checks no token."""
        return json.loads(self.key_file.read_text())[kind]["key"] if self.token_auth else None

    def call(self, method: str, url: str, key_kind: str | None, body: bytes | None = None,
             content_type: str | None = None, timeout: float = 120) -> tuple[int, bytes]:
        """One HTTP call; returns (status, body) for any status."""
        status, payload, _ = self.exchange(method, url, key_kind, body, content_type, timeout)
        return status, payload

    def exchange(self, method: str, url: str, key_kind: str | None, body: bytes | None = None,
                 content_type: str | None = None, timeout: float = 120) -> tuple[int, bytes, Message]:
        """One HTTP call; returns (status, body, the response's headers) for any status."""
        req = request.Request(url, data=body, method=method)
        key = None if key_kind is None else self.key(key_kind)
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        if content_type is not None:
            req.add_header("Content-Type", content_type)
        try:
            with request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read(), resp.headers
        except error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers

    def management(self, method: str, path: str, timeout: float = 120) -> tuple[int, bytes]:
        return self.call(method, f"{self.management_url}{path}", "management", timeout=timeout)


def read_properties(config: Path) -> dict[str, str]:
    props = {}
    for line in config.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            props[key.strip()] = value.strip()
    return props


def server_for(config: Path, run_dir: Path) -> Server:
    props = read_properties(config)
    return Server(
        run_dir=run_dir,
        inference_url=props.get("inference_address", "http://127.0.0.1:8080"),
        management_url=props.get("management_address", "http://127.0.0.1:8081"),
        metrics_url=props.get("metrics_address", "http://127.0.0.1:8082"),
        token_auth=props.get("disable_token_authorization", "false").strip().lower() != "true",
    )


# A TCP port TorchServe listens on, in config.properties: the workers' initial_worker_port names Unix sockets instead
LISTENING_PORT = re.compile(r"(_address=http://127\.0\.0\.1:|(?<!initial_worker)_port=)(\d+)")


def listening_ports(properties: str) -> list[int]:
    """The TCP ports a config.properties' text has TorchServe listen on."""
    return [int(match[2]) for match in LISTENING_PORT.finditer(properties)]


def shifted_config(out_dir: Path, shift: int, config: Path = DEFAULT_CONFIG, extra: Sequence[str] = ()) -> Path:
    """``config`` with every port moved by ``shift`` (worker ports too), written to ``out_dir``, so that servers
    for tests (+10000 ... +17000), benchmarks (+20000, +22000) and a dev server (+0) never collide. ``extra``:
    KEY=VALUE lines appended (a key set twice takes the last value, as TorchServe reads properties).

    Every port should stay below the kernel's ephemeral range (Linux: from 32768), where any client socket may be
    given it: benchmarks at +30000 (38080-38082) once found 38082 held by a socket of the run before, and TorchServe
    failed to bind it."""
    text = LISTENING_PORT.sub(lambda m: f"{m[1]}{int(m[2]) + shift}", config.read_text())
    highest = max(listening_ports(text))
    text += f"\ninitial_worker_port={9000 + shift}\n"
    ephemeral = ephemeral_ports()
    if ephemeral and highest >= ephemeral:
        print(f"[start] warning: port {highest} is in the kernel's ephemeral range (from {ephemeral}): a client "
              "socket may hold it and TorchServe fail to bind; a smaller port shift avoids that", flush=True)
    path = out_dir / config.name
    path.write_text(text + "".join(f"{line}\n" for line in extra))
    return path


def ephemeral_ports() -> int | None:
    """The first port the kernel hands out to client sockets (Linux), or None where it does not say."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def server_env(run_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the archive must bring its own code
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TMPDIR=str(run_dir / "tmp"),  # TorchServe keeps its pid file in the temp dir
    )
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DEFAULT_CACHE_DIR.resolve()))  # the server runs in run_dir
    env.update(extra or {})
    return env


def start(config: Path, model_store: Path, models: list[str], run_dir: Path, timeout: float,
          extra_env: dict[str, str] | None = None, every_worker: bool = False, venv: Path | None = None) -> Server:
    """Start TorchServe in ``run_dir`` with ``models`` ("name=file.mar") and wait until each is READY: one worker
    serves; ``every_worker`` waits for each model's ``minWorkers`` (workers on the same cores load in turn, and a
    benchmark timed while the next one loads measures its compile). ``extra_env`` goes to the server and its workers
    (e.g. TORCHINDUCTOR_CACHE_DIR). ``venv``: the TorchServe installed there, whose workers run its Python (a
    benchmark's baseline); by default this Python's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tmp").mkdir(exist_ok=True)
    config = with_absolute_paths(config, run_dir)
    server = server_for(config, run_dir)
    torchserve = str((venv / "bin" if venv else Path(sys.executable).parent) / "torchserve")
    command = [torchserve, "--start", "--ncs", "--ts-config", str(config), "--model-store", str(model_store)]
    if models:
        command += ["--models", *models]
    print(f"[start] in {run_dir}: {shlex.join(command)}", flush=True)
    # The server inherits these streams; a file keeps it from holding the caller's pipe open.
    with open(run_dir / "torchserve.out", "ab") as out:
        subprocess.run(command, cwd=run_dir, env=server_env(run_dir, extra_env), check=True, stdout=out,
                       stderr=out)
    try:
        wait_for_key_file(server, timeout=60)
        for name in [m.split("=", 1)[0].removesuffix(".mar") for m in models]:
            wait_ready(server, name, timeout)
            if every_worker:
                wait_ready(server, name, timeout, count=min_workers(server, name))
    except BaseException:  # a server that will not come up must not keep its ports (and workers) busy
        stop(run_dir)
        raise
    return server


PATH_KEYS = ("metrics_config",)  # relative to where torchserve starts in the shipped configs: .run/
SHIPPED_RUN_DIR = DEFAULT_RUN_DIR  # under the current directory, as the defaults are


def with_absolute_paths(config: Path, run_dir: Path) -> Path:
    """``config`` as TorchServe reads it from ``run_dir``: relative paths in it were written for .run/ (where
    ``python -m handlers start`` starts TorchServe by default), so a server started elsewhere gets a copy with them
    absolute."""
    text = config.read_text()
    absolute = re.sub(rf"^({'|'.join(PATH_KEYS)})=(?!/)(.+)$",
                      lambda m: f"{m[1]}={(SHIPPED_RUN_DIR / m[2].strip()).resolve()}", text, flags=re.MULTILINE)
    if absolute == text:
        return config
    path = run_dir / f"effective-{config.name}"
    path.write_text(absolute)
    return path


def wait_for_key_file(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            server.key("management")
            return
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)
    raise TimeoutError(f"TorchServe wrote no key file at {server.key_file} in {timeout:.0f}s")


def _versions(server: Server, name: str) -> list[dict]:
    """The management API's description of ``name``, one entry per version; none if it does not answer 200."""
    status, body = server.management("GET", f"/models/{name}", timeout=10)
    return json.loads(body) if status == 200 else []


def workers(server: Server, name: str) -> list[dict]:
    return [w for entry in _versions(server, name) for w in entry.get("workers", [])]


def worker_status(worker: dict) -> str:
    """A worker's status for a person. TorchServe 0.12 lists every worker that is not serving as UNLOADING, a loading
    one too (its describe knows READY and UNLOADING only), which reads as if the worker were going away."""
    status = worker.get("status", "?")
    return "not READY (loading, or stopping: TorchServe says UNLOADING for both)" if status == "UNLOADING" else status


def min_workers(server: Server, name: str) -> int:
    return max((entry.get("minWorkers", 1) for entry in _versions(server, name)), default=1)


def wait_ready(server: Server, name: str, timeout: float, count: int = 1) -> None:
    """Wait until ``count`` workers of ``name`` are READY, printing progress every 10 seconds."""
    started = time.monotonic()
    last_print = 0.0
    log = server.run_dir / "logs" / "model_log.log"
    log_offset = log.stat().st_size if log.is_file() else 0
    while True:
        elapsed = time.monotonic() - started
        try:
            listed = workers(server, name)
        except OSError:
            listed = []
        if sum(w.get("status") == "READY" for w in listed) >= count:
            print(f"[start] {name}: {count} worker(s) READY after {elapsed:.0f}s", flush=True)
            return
        if exited := server_exited(server.run_dir):  # e.g. a port taken: the workers would never come
            raise RuntimeError(f"TorchServe exited while {name} was loading: {exited} (see {server.run_dir})")
        failure = load_failure(log, log_offset, name)
        if failure:  # deterministic (an invalid YAML, no safetensors): TorchServe would retry it with backoff forever
            raise RuntimeError(f"{name} failed to load: {failure}. TorchServe keeps retrying it with backoff; fix the "
                               f"archive, re-package, and restart (logs: {server.run_dir}/logs)")
        if elapsed > timeout:
            raise TimeoutError(f"{name} not READY after {timeout:.0f}s (workers: {_statuses(listed)}); "
                               f"see {server.run_dir}/logs")
        if elapsed - last_print >= 10:
            print(f"[start] {name}: waiting for READY ({elapsed:.0f}s; workers: {_statuses(listed) or 'starting'})"
                  f"{last_rung_line(log, log_offset)}", flush=True)
            last_print = elapsed
        time.sleep(1)


def _statuses(listed: list[dict]) -> str:
    return ", ".join("READY" if w.get("status") == "READY" else "not READY" for w in listed)


def server_pid(run_dir: Path) -> int | None:
    """The process of the TorchServe started in ``run_dir`` (its pid file is in the run's temp dir), if it wrote one."""
    try:
        return int((run_dir / "tmp" / ".model_server.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # no such process, or another user's under a reused pid
        return True
    return False


def server_exited(run_dir: Path) -> str | None:
    """Why the TorchServe started in ``run_dir`` is gone (the last error line it printed), or None while its process
    lives (or has not written its pid file yet)."""
    pid = server_pid(run_dir)
    if pid is None or not gone(pid):
        return None
    out = run_dir / "torchserve.out"
    lines = out.read_text(errors="replace").splitlines() if out.is_file() else []
    errors = [line.strip() for line in lines if re.match(r"[\w.$]+(Exception|Error): ", line)]  # not "Caused by"
    return errors[-1] if errors else "no error printed"


CRASHES_BEFORE_GIVING_UP = 3  # a worker that dies while loading this often will not come up by itself


def load_failure(log: Path, offset: int, name: str) -> str | None:
    """Why ``name`` cannot load, from the model log since ``offset``: the reason pt2-handlers logged, or the last
    error line of a worker that died loading it (e.g. importing the handler) CRASHES_BEFORE_GIVING_UP times."""
    marker = f"model {name} failed to load: "
    if not log.is_file():
        return None
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if f"-{name}_" in line or marker in line]
    reason = next((line.split(marker, 1)[1].strip() for line in lines if marker in line), None)
    if reason:
        return reason
    crashes = [line for line in lines if "MODEL_LOG - Traceback (most recent call last)" in line]
    errors = [line.split("MODEL_LOG - ", 1)[1] for line in lines
              if re.search(r"MODEL_LOG - \w+(\.\w+)*(Error|Exception): ", line)]
    return f"the worker died {len(crashes)} times: {errors[-1]}" if len(crashes) >= CRASHES_BEFORE_GIVING_UP \
        and errors else None


def last_rung_line(log: Path, offset: int) -> str:
    """The newest ladder progress line written to the model log since ``offset``."""
    if not log.is_file():
        return ""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if "rung " in line]
    return f" -- {re.sub(r'^.*?rung ', 'rung ', lines[-1])}" if lines else ""


def stop(run_dir: Path, timeout: float = 30) -> None:
    """``torchserve --stop``, then wait (up to ``timeout``) until its process is gone: it returns first, and a
    server started right after found the ports still taken."""
    pid = server_pid(run_dir)
    torchserve = str(Path(sys.executable).parent / "torchserve")
    subprocess.run([torchserve, "--stop"], cwd=run_dir, env=server_env(run_dir), check=False)
    deadline = time.monotonic() + timeout
    while pid is not None and not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def usage_hint(server: Server, name: str, task: str | None = None) -> str:
    """How to call ``name`` with curl: a text, or for an image classifier a picture's bytes (``task``)."""
    key = f"$(python3 -c 'import json;print(json.load(open(\"{server.key_file}\"))[\"inference\"][\"key\"])')"
    mkey = key.replace('"inference"', '"management"')
    run_dir = "" if server.run_dir == DEFAULT_RUN_DIR.resolve() else f" --run-dir {shlex.quote(str(server.run_dir))}"
    body = ("-T photo.jpg" if task == "image-classification" else
            "-H 'Content-Type: application/json' -d '{\"text\": \"hello world\"}'")
    return "\n".join([
        "Call it (the keys stay in the key file; these commands read them):",
        f'  curl -s -H "Authorization: Bearer {key}" \\',
        f"       {body} \\",
        f"       {server.inference_url}/predictions/{name}",
        f'  curl -s -H "Authorization: Bearer {mkey}" "{server.management_url}/models/{name}?customized=true"',
        f"Stop it: python -m handlers stop{run_dir}",
    ])


# --- the command line: python -m handlers [--config ...] [--run-dir ...] start|stop ---


def add_server_options(parser: argparse.ArgumentParser, in_command: bool = False) -> None:
    """--config and --run-dir, which name the server (``args.server_config``, ``args.run_dir``). ``python -m handlers``
    takes them before the command, and each server command (``in_command``) after it too; there they default to
    nothing, so a value given before the command stays unless given again."""
    for flag, dest, default, says in (
            ("--config", "server_config", DEFAULT_CONFIG, "the server's config.properties"),
            ("--run-dir", "run_dir", DEFAULT_RUN_DIR, "where its key_file.json, logs and pid file are")):
        parser.add_argument(flag, dest=dest, type=Path, default=argparse.SUPPRESS if in_command else default,
                            metavar=flag.removeprefix("--").upper(), help=f"{says} (default: {default})")


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``start`` and ``stop``."""
    start_p = commands.add_parser(
        "start", help="start TorchServe (token auth on) and wait until each model is READY",
        description="Run torchserve --start in --run-dir (its key file, logs and pid file land there), wait until each "
                    "model has a READY worker, then print how to call it. It never prints a key.")
    add_server_options(start_p, in_command=True)
    start_p.add_argument("--model-store", type=Path, default=DEFAULT_MODEL_STORE,
                         help="where the archives are (default: %(default)s)")
    start_p.add_argument("--timeout", type=float, default=900, help="seconds to wait for READY")
    start_p.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                         help="NAME=ARCHIVE, e.g. minilm=minilm.mar (the default)")
    start_p.set_defaults(run=run_start)
    stop_p = commands.add_parser("stop", help="stop the TorchServe started in --run-dir (torchserve --stop)")
    add_server_options(stop_p, in_command=True)
    stop_p.set_defaults(run=run_stop)


def run_start(args: argparse.Namespace) -> int:
    server = start(args.server_config.resolve(), args.model_store.resolve(), args.models, args.run_dir.resolve(),
                   args.timeout)
    for model in args.models:
        name = model.split("=", 1)[0]
        print(usage_hint(server, name, served_task(server, name)))
    return 0


def served_task(server: Server, name: str) -> str | None:
    """The model's task, as its worker describes it; None where it does not say."""
    status, raw = server.management("GET", f"/models/{name}?customized=true")
    try:
        return json.loads(raw)[0]["customizedMetadata"]["task"] if status == 200 else None
    except (ValueError, LookupError, TypeError):
        return None


def run_stop(args: argparse.Namespace) -> int:
    stop(args.run_dir.resolve())
    return 0
