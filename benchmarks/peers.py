"""Peer embedding servers for ``python -m benchmarks.e2e --peers``: Infinity (infinity-emb) on its torch and its optimum
(ONNX Runtime) engine, serving the same MiniLM directory the archives are built from, on 127.0.0.1.

Infinity pins transformers <= 5.0 and sentence-transformers < 4, so it runs from a venv of its own, built on demand
outside the clone by ``scripts/setup.sh --profile infinity`` (pins: constraints/infinity.txt; never built in CI). Each
peer runs as ``infinity_emb v2`` with mean pooling, batch size 32, Infinity's CPU defaults otherwise (fp32, no
torch.compile), no hub access (HF_HUB_OFFLINE=1), no telemetry (DO_NOT_TRACK=1) and an API key (TorchServe's token
auth is on too), and answers at its OpenAI-style ``/embeddings`` route.

The optimum engine loads an ONNX file from the model directory; ours has none. Infinity 0.0.78 would export nothing
and, for a local directory, passes ONNX Runtime a file name optimum-onnx 0.1.0 cannot match, and its own ORT-optimizer
call fails on optimum 2 (``OptimizationConfig`` lost ``optimize_with_onnxruntime_only``) -- it would then serve the
unoptimized graph. So this module does that step the way Infinity means it, in Infinity's venv: optimum's
``main_export`` (feature-extraction, transformers outputs) and ``ORTOptimizer`` at optimization_level 99 for CPU (the
settings Infinity passes), and puts ``model_optimized.onnx`` into a directory of links to the model's files: Infinity
finds it there ("Optimized model found ... skipping optimization") and serves it.

Run as a file inside that venv (it imports nothing of this repository, so it needs neither package there), it does
the export:

    VENV/bin/python benchmarks/peers.py export-onnx MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
INFINITY_ENGINES = {"infinity-torch": "torch", "infinity-optimum": "optimum"}
PEERS = tuple(INFINITY_ENGINES)
LABELS = {"infinity-torch": "Infinity torch", "infinity-optimum": "Infinity optimum (ORT)"}
SERVED_NAME = "minilm"
MIN_COSINE = 0.99  # a peer whose answers differ more than this from the reference gets no row
ONNX_FILE = "model_optimized.onnx"  # the name Infinity looks for (utils_optimum.optimize_model)


def log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def infinity_venv() -> Path:
    """Build (first time, ~1 min, ~1.6 GB) or find the infinity profile's venv; its path."""
    from benchmarks.harness import profile_venv  # this file also runs as a script in that venv, without the package

    return profile_venv("infinity", "bin/infinity_emb")


def onnx_model_dir(venv: Path, model_dir: Path, work: Path, timeout: float) -> tuple[Path, float]:
    """A directory of links to ``model_dir``'s files plus the ORT-optimized ONNX export; (it, seconds taken)."""
    target = work / "infinity-onnx-model"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for entry in model_dir.iterdir():
        if not entry.name.startswith("."):
            (target / entry.name).symlink_to(entry.resolve())
    started = time.monotonic()
    log(f"exporting {model_dir} to ONNX and optimizing it for ONNX Runtime (in the Infinity venv)")
    with tempfile.TemporaryDirectory(prefix="onnx-export-", dir=work) as tmp:
        command = [str(venv / "bin" / "python"), str(Path(__file__).resolve()), "export-onnx", str(model_dir), tmp]
        done = subprocess.run(command, env=peer_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        if done.returncode or not (Path(tmp) / ONNX_FILE).is_file():
            print(done.stdout[-3000:], flush=True)
            raise SystemExit(f"the ONNX export for Infinity's optimum engine failed (exit {done.returncode})")
        for produced in Path(tmp).glob(f"{Path(ONNX_FILE).stem}*"):  # the graph, and its weights if kept apart
            shutil.move(produced, target / produced.name)
    seconds = time.monotonic() - started
    log(f"ONNX export + ORT optimization: {seconds:.1f}s ({(target / ONNX_FILE).stat().st_size / 2**20:.0f} MiB)")
    return target, seconds


def peer_env(work: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
                "INFINITY_ANONYMOUS_USAGE_STATS": "false", "HF_HUB_CACHE": str(work / "hf-cache"),
                "HF_HOME": str(work / "hf-home"), "TOKENIZERS_PARALLELISM": "false"})
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec: SIGTERM when the benchmark dies (Linux)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class InfinityPeer:
    """One ``infinity_emb v2`` process on 127.0.0.1, started and stopped by the benchmark."""

    path = "/embeddings"

    def __init__(self, name: str, venv: Path, model_dir: Path, work: Path, batch_size: int = 32):
        self.name, self.engine, self.label = name, INFINITY_ENGINES[name], LABELS[name]
        self.venv, self.model_dir, self.work, self.batch_size = venv, model_dir, work, batch_size
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = secrets.token_hex(16)
        self.log_file = work / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "infinity_emb"), "v2", "--model-id", str(self.model_dir),
                "--served-model-name", SERVED_NAME, "--engine", self.engine, "--device", "cpu",
                "--batch-size", str(self.batch_size), "--pooling-method", "mean", "--no-compile",
                "--no-vector-disk-cache", "--host", "127.0.0.1", "--port", str(self.port), "--api-key", self.key]

    def body(self, text: str) -> dict[str, Any]:
        return {"model": SERVED_NAME, "input": text}

    def start(self, timeout: float) -> float:
        """Start it and wait for /health; the seconds that took. Raises (with its log's tail) if it never answers."""
        command = self.command()
        shown = [part if part != self.key else "***" for part in command]
        log(f"starting {self.name}: {' '.join(shown)} (log: {self.log_file})")
        started = time.monotonic()
        with self.log_file.open("wb") as out:
            self.proc = subprocess.Popen(command, cwd=self.work, env=peer_env(self.work), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"{self.name} exited with {self.proc.returncode} before answering")
            if self._healthy():
                self.startup_seconds = time.monotonic() - started
                log(f"{self.name} READY in {self.startup_seconds:.1f}s (pid {self.proc.pid}, {self.url})")
                return self.startup_seconds
            time.sleep(0.5)
        self._fail(f"{self.name} did not answer /health within {timeout:.0f}s")
        raise AssertionError("unreachable")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _fail(self, message: str) -> None:
        self.stop()
        tail = self.log_file.read_text(errors="replace").splitlines()[-25:] if self.log_file.is_file() else []
        print("\n".join(tail), flush=True)
        raise SystemExit(f"{message}; its log: {self.log_file}")

    def embed(self, text: str) -> list[float]:
        request = urllib.request.Request(f"{self.url}{self.path}", data=json.dumps(self.body(text)).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["data"][0]["embedding"]

    def stop(self, grace: float = 20) -> None:
        """SIGTERM to its process group (it started one), SIGKILL after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        log(f"stopped {self.name} (exit {self.proc.returncode})")


def start_peers(names: Sequence[str], model_dir: Path, work: Path, batch_size: int,
                timeout: float) -> tuple[list[InfinityPeer], dict[str, Any]]:
    """Build/find the venv, export the ONNX model if the optimum engine is asked for, start each peer in turn.
    Returns the running peers and what it took (for the run's JSON). Stops those it started if one fails."""
    info: dict[str, Any] = {}
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    venv = infinity_venv()
    info["venv"] = {"path": str(venv), "seconds": round(time.monotonic() - started, 1),
                    "versions": venv_versions(venv)}
    log(f"Infinity venv holds {info['venv']['versions']}")
    peers: list[InfinityPeer] = []
    try:
        for name in names:
            directory = model_dir
            if INFINITY_ENGINES[name] == "optimum":
                directory, seconds = onnx_model_dir(venv, model_dir, work, timeout)
                info["onnx_export_seconds"] = round(seconds, 1)
            peer = InfinityPeer(name, venv, directory, work, batch_size)
            peers.append(peer)
            peer.start(timeout)
            info[name] = {"command": " ".join(p if p != peer.key else "***" for p in peer.command()),
                          "startup_seconds": round(peer.startup_seconds or 0, 1), "log": str(peer.log_file)}
    except BaseException:
        stop_peers(peers)
        raise
    return peers, info


def stop_peers(peers: Sequence[InfinityPeer]) -> None:
    for peer in peers:
        peer.stop()


def venv_versions(venv: Path) -> dict[str, str]:
    names = ("infinity-emb", "torch", "transformers", "sentence-transformers", "optimum", "optimum-onnx", "onnxruntime")
    code = ("import importlib.metadata as m, json, sys\n"
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code, *names], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def reference_embeddings(model_dir: Path, texts: Sequence[str]) -> tuple[list[list[float]], str]:
    """What the peers are checked against: sentence-transformers on the model directory if it imports here, else
    the fp32 eager HF model with mean pooling + L2 norm (what sentence-transformers computes for this model)."""
    try:
        from sentence_transformers import SentenceTransformer, __version__
    except ImportError:
        return _eager_reference(model_dir, texts), "fp32 eager transformers, mean pooling + L2 norm"
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    vectors = model.encode(list(texts), batch_size=8, normalize_embeddings=True, convert_to_numpy=True)
    return [v.tolist() for v in vectors], f"sentence-transformers {__version__} (fp32, normalized)"


def _eager_reference(model_dir: Path, texts: Sequence[str]) -> list[list[float]]:
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = transformers.AutoModel.from_pretrained(str(model_dir), local_files_only=True).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            batch = tokenizer([text], truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1)[0].tolist())
    return out


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def check_peers(peers: Sequence[InfinityPeer], texts: Sequence[str], reference: Sequence[Sequence[float]],
                reference_name: str) -> dict[str, dict[str, Any]]:
    """Each peer's answers vs the reference on ``texts`` (one request per text, as the load sends them)."""
    results = {}
    for peer in peers:
        values = [cosine(peer.embed(text), ref) for text, ref in zip(texts, reference, strict=True)]
        ok = min(values) >= MIN_COSINE
        results[peer.name] = {"texts": len(texts), "reference": reference_name, "min_cosine": round(min(values), 8),
                              "ok": ok}
        verdict = "OK" if ok else (f"REFUSED: below {MIN_COSINE}, so its answers are not the same embeddings; "
                                   "no row is timed for it")
        log(f"{peer.name} vs {reference_name}: min cosine {min(values):.8f} over {len(texts)} texts -- {verdict}")
    return results


def _export_main(model_dir: str, out_dir: str) -> None:
    """In the Infinity venv: ONNX export (last_hidden_state) + ORT optimization as Infinity configures it on CPU."""
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
    from optimum.onnxruntime.configuration import OptimizationConfig

    exported = Path(out_dir) / "exported"
    main_export(model_name_or_path=model_dir, output=exported, task="feature-extraction",
                library_name="transformers", local_files_only=True)  # transformers outputs: last_hidden_state
    model = ORTModelForFeatureExtraction.from_pretrained(exported, file_name="model.onnx")
    config = OptimizationConfig(optimization_level=99, optimize_for_gpu=False, fp16=False)
    ORTOptimizer.from_pretrained(model).optimize(optimization_config=config, save_dir=out_dir, one_external_file=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "export-onnx":
        raise SystemExit(f"usage: {sys.argv[0]} export-onnx MODEL_DIR OUT_DIR (benchmarks.e2e --peers runs it)")
    _export_main(sys.argv[2], sys.argv[3])
