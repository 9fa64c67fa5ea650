"""A model defined by a Python file and loaded from its state_dict, as torch-model-archiver packs it with
``--model-file model.py --serialized-file model.pth``; or a ``torch.export`` program (``.pt2``).

Weights are tensors only. A ``.safetensors`` file holds nothing else; a ``.pth``/``.pt`` pickle is first read
opcode by opcode, without unpickling it, and refused if it names any object beyond what a state_dict of tensors
needs (a pickled whole model names its class, and unpickling it would run that module's code, or worse); then it is
loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import logging
import pickletools
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from handlers.errors import ModelLoadError
from handlers.models.files import Form, ModelFiles, inside

logger = logging.getLogger(__name__)

SAVE_A_STATE_DICT = ("save the weights alone instead: torch.save(model.state_dict(), 'model.pth') (or safetensors' "
                     "save_file), and package the class with --model-file")


def load_module(root: Path, files: ModelFiles, device: torch.device) -> torch.nn.Module:
    """The archive's fp32 model in eval mode on ``device``: model.py's class with the state_dict loaded, or the
    exported program's module."""
    files.check()
    started = time.perf_counter()
    if files.form is Form.EXPORTED:
        model = exported_module(inside(root, files.serialized_file or "", "--serialized-file"))
    else:
        model = module_class(inside(root, files.model_file or "", "--model-file"))()
        weights = read_state_dict(inside(root, files.serialized_file or "", "--serialized-file"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ModelLoadError(f"{files.serialized_file} does not fit {type(model).__name__}: "
                                 f"{_keys('missing', missing)}{_keys('unexpected', unexpected)}".rstrip("; "))
        model = model.float().eval()
    model = model.to(device)
    logger.info("loaded %s (%s) from %s in %.1fs", type(model).__name__, files.form.value,
                files.serialized_file, time.perf_counter() - started)
    return model


def _keys(kind: str, keys: list[str]) -> str:
    return f"{len(keys)} {kind} key(s) ({', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}); " if keys else ""


def module_class(path: Path) -> type[torch.nn.Module]:
    """The one ``nn.Module`` class defined in ``path`` (TorchServe's rule for ``--model-file``), which must be built
    without arguments."""
    name = f"pt2_model_file_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"--model-file {path.name} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up by name
    sys.path.insert(0, str(path.parent))  # the archive root: model.py may import its --extra-files
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelLoadError(f"--model-file {path.name} failed to import: {type(exc).__name__}: {exc}") from exc
    classes = [value for value in vars(module).values() if inspect.isclass(value)
               and issubclass(value, torch.nn.Module) and value.__module__ == name]
    if len(classes) != 1:
        found = ", ".join(cls.__name__ for cls in classes) or "none"
        raise ModelLoadError(f"--model-file {path.name} must define exactly one torch.nn.Module class (TorchServe's "
                             f"rule), found {found}")
    model_class = classes[0]
    required = [param.name for param in inspect.signature(model_class.__init__).parameters.values()
                if param.name != "self" and param.default is inspect.Parameter.empty
                and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)]
    if required:
        raise ModelLoadError(f"{model_class.__name__} in {path.name} takes {', '.join(required)}: the class must be "
                             "built without arguments (give them defaults)")
    return model_class


def read_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    """A mapping of names to tensors from a safetensors file or a tensors-only pickle; ModelLoadError (saying how to
    save a state_dict) for anything else, found before anything is unpickled."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a corrupt file is the archive's problem, told as such
            raise ModelLoadError(f"{path.name} is not a readable safetensors file: {exc}") from exc
    refuse_code_in_pickle(path)
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{path.name} cannot be loaded as tensors only ({type(exc).__name__}): "
                             f"{SAVE_A_STATE_DICT}") from exc
    if not isinstance(weights, Mapping) or not all(isinstance(value, torch.Tensor) for value in weights.values()):
        kind = type(weights).__name__
        raise ModelLoadError(f"{path.name} holds a {kind}, not a state_dict of tensors: {SAVE_A_STATE_DICT}")
    return weights


def refuse_code_in_pickle(path: Path) -> None:
    """ModelLoadError naming the first object a pickle would import that a state_dict of tensors does not need
    (read from the opcodes, nothing is executed)."""
    allowed = _allowed_globals()
    for module, name in pickle_globals(path):
        if f"{module}.{name}" not in allowed:
            raise ModelLoadError(
                f"{path.name} is a pickle that imports {module}.{name}: a whole pickled model or other objects, not a "
                f"state_dict of tensors; it is not loaded (unpickling runs code): {SAVE_A_STATE_DICT}")


def _allowed_globals() -> set[str]:
    """What ``torch.load(weights_only=True)`` would accept: tensors, storages, dtypes, ordered dicts."""
    from torch import _weights_only_unpickler

    return set(_weights_only_unpickler._get_allowed_globals())


def pickle_globals(path: Path) -> Iterator[tuple[str, str]]:
    """(module, name) of every global the pickle in ``path`` (torch's zip format or a bare pickle) refers to."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for entry in archive.namelist():
                if entry.endswith(".pkl"):
                    yield from _globals_of(archive.read(entry), path.name)
        return
    yield from _globals_of(path.read_bytes(), path.name)


def _globals_of(data: bytes, name: str) -> Iterator[tuple[str, str]]:
    names = _PickleNames(name)
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(data)):
            found = names.step(opcode.name, argument, bool(opcode.stack_after))
            if found:
                yield found
            if opcode.name == "STOP":
                break
    except (ValueError, EOFError) as exc:
        raise ModelLoadError(f"{name} is not a torch.save file ({exc}): {SAVE_A_STATE_DICT}") from None


class _PickleNames:
    """The pickle's GLOBAL/INST names, and STACK_GLOBAL's two strings (pushed, or fetched from the memo)."""

    def __init__(self, file_name: str):
        self.file_name = file_name
        self.strings: list[str | None] = []  # what each push left on top, where it was a string
        self.memo: dict[int, str | None] = {}

    def step(self, opcode: str, argument: Any, pushes: bool) -> tuple[str, str] | None:
        if opcode in ("GLOBAL", "INST"):
            module, _, attr = str(argument).partition(" ")
            return module, attr
        if opcode == "STACK_GLOBAL":
            module, attr = self.strings[-2:] if len(self.strings) >= 2 else (None, None)
            if module is None or attr is None:
                raise ModelLoadError(f"{self.file_name}: a pickle whose imports cannot be read; {SAVE_A_STATE_DICT}")
            return module, attr
        top = self.strings[-1] if self.strings else None
        if opcode == "MEMOIZE":
            self.memo[len(self.memo)] = top
        elif opcode in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.memo[int(argument)] = top
        elif opcode in ("GET", "BINGET", "LONG_BINGET"):
            self.strings.append(self.memo.get(int(argument)))
        elif "UNICODE" in opcode or "STRING" in opcode:
            self.strings.append(str(argument))
        elif pushes:
            self.strings.append(None)
        return None


def exported_module(path: Path) -> torch.nn.Module:
    """The module of a ``torch.export.save`` program."""
    try:
        program = torch.export.load(str(path))
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{path.name} is not a torch.export program (torch.export.save): "
                             f"{type(exc).__name__}: {exc}") from exc
    return program.module()
