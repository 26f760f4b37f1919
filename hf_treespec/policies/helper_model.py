"""Save / load for the few-KB networks a policy ships beside its drafter (the C2T classifier, the NDE selector).

Such a folder is ``config.json`` (the config dataclass, with a type tag) + ``model.safetensors``; loading refuses a
folder of another kind or with files missing, and says how to make the right one.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class HelperModelMixin:
    """``save_pretrained`` / ``from_pretrained`` for an ``nn.Module`` whose ``config`` is a dataclass carrying
    ``type_field == type_tag``; ``kind`` names it in errors and ``how_to_train`` tells how to make one."""

    config_class: ClassVar[type]
    type_field: ClassVar[str]
    type_tag: ClassVar[str]
    kind: ClassVar[str]
    how_to_train: ClassVar[str]

    def save_pretrained(self, folder: str | Path) -> None:
        """Writes ``config.json`` and ``model.safetensors`` (weights and buffers such as standardisation stats)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: torch.device | str | None = None):
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise ValueError(f"{folder} is not a {cls.kind} folder (needs {CONFIG_NAME} and {WEIGHTS_NAME}). "
                             + cls.how_to_train)
        config = json.loads((folder / CONFIG_NAME).read_text())
        if config.get(cls.type_field) != cls.type_tag:
            raise ValueError(f"{folder / CONFIG_NAME} does not describe a {cls.kind} ({cls.type_field}="
                             f"{config.get(cls.type_field)!r}). " + cls.how_to_train)
        model = cls(cls.config_class(**config))
        model.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
        return model.to(device).eval() if device is not None else model.eval()

    @classmethod
    def resolve(cls, value, kwarg: str):
        """The network a generate kwarg names: an instance (used as is, in eval mode) or its folder."""
        if isinstance(value, cls):
            return value.eval()
        if isinstance(value, (str, Path)):
            return cls.from_pretrained(value)
        raise TypeError(f"{kwarg} must be a {cls.kind} folder or a {cls.__name__}, got {type(value).__name__}.")
