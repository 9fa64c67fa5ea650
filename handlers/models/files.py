"""Which model an archive carries, named as torch-model-archiver names it: ``--model-file`` (a Python file defining one
``nn.Module`` class) with ``--serialized-file`` (its state_dict), a ``--serialized-file`` alone that is a
``torch.export`` program (``.pt2``), or neither: a Hugging Face ``save_pretrained`` directory in the archive.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from handlers.errors import ModelLoadError

EXPORTED_SUFFIX = ".pt2"
STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")


class Form(str, enum.Enum):
    PRETRAINED = "pretrained"  # a save_pretrained directory (pt2_handlers.model_dir)
    STATE_DICT = "state_dict"  # model.py + its weights
    EXPORTED = "exported"  # a torch.export program


@dataclass(frozen=True)
class ModelFiles:
    """The archive's model files, relative to its root (TorchServe's manifest: ``model.modelFile`` and
    ``model.serializedFile``)."""

    model_file: str | None = None
    serialized_file: str | None = None

    @property
    def form(self) -> Form:
        if self.model_file:
            return Form.STATE_DICT
        if self.serialized_file:
            return Form.EXPORTED
        return Form.PRETRAINED

    def check(self) -> None:
        """ModelLoadError for a pair no loader reads: weights without the class, or a class without weights, or a
        serialized file of a kind this package does not load."""
        if self.model_file and not self.serialized_file:
            raise ModelLoadError(f"--model-file {self.model_file} has no --serialized-file: package its state_dict "
                                 "(torch.save(model.state_dict(), 'model.pth')) beside it")
        suffix = Path(self.serialized_file or "").suffix
        if self.form is Form.STATE_DICT and suffix not in STATE_DICT_SUFFIXES:
            raise ModelLoadError(f"--serialized-file {self.serialized_file}: a state_dict is read from a "
                                 f"{', '.join(STATE_DICT_SUFFIXES)} file")
        if self.form is Form.EXPORTED and suffix != EXPORTED_SUFFIX:
            raise ModelLoadError(
                f"--serialized-file {self.serialized_file} without --model-file: only a torch.export program "
                f"({EXPORTED_SUFFIX}, torch.export.save) carries its own code; a state_dict needs the --model-file "
                "that defines its class, and a pickled whole model is not loaded (it runs code when unpickled)")

    def describe(self) -> dict[str, str]:
        """The form, and the files that make it (TorchServe's describe drops keys whose value is null)."""
        files = {"model_file": self.model_file, "serialized_file": self.serialized_file}
        return {"form": self.form.value, **{key: name for key, name in files.items() if name}}


SAVE_PRETRAINED = ModelFiles()  # neither file: the archive holds a save_pretrained directory


def inside(root: Path, relative: str, what: str) -> Path:
    """``root / relative``, which must stay inside the archive; ModelLoadError otherwise or where it is missing."""
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ModelLoadError(f"{what} {relative!r} leads outside the model archive ({root})")
    if not path.is_file():
        raise ModelLoadError(f"{what} {relative!r} is not in the model archive ({root})")
    return path
