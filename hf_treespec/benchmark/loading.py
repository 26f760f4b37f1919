"""What a benchmark (or a trainer that evaluates) loads by name: the target, the drafter a ``--drafter`` spec names,
the question sets and the chat prompts built from them. Shared by ``hf-treespec bench``, ``calibrate`` and the
training commands, so a name means the same model everywhere."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..assets import default_drafter
from ..drafters import TreeSpecDrafterModel, prompt_lookup, truncated
from ..generation import enable
from ..cost.hardware import DTYPES

def _mtbench(limit: int | None):
    from ..assets import load_questions

    return load_questions(None, limit)


def _sharegpt_dev(limit: int | None):
    from ..assets import sharegpt_prompts

    return sharegpt_prompts("dev", limit)


#: --dataset name -> loader(limit) of question lists
DATASETS: dict[str, Callable[[int | None], list]] = {"mtbench": _mtbench, "sharegpt-dev": _sharegpt_dev}


def _whole_number(arg: str, default: int | None = None) -> int:
    """The ``N`` of ``--drafter kind:N`` (``default`` when it is left out, where the kind has one)."""
    if not arg and default is not None:
        return default
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"expected a whole number after ':', got {arg!r}.") from None


def _default_drafter(model: torch.nn.Module, arg: str, target_name: str | None) -> torch.nn.Module:
    """``default`` / ``default:<target>``: the drafter shipped for the named target, else for the loaded one."""
    name = arg or target_name
    return default_drafter(model) if name is None else default_drafter(model, target=name)


def _oracle_drafter(model: torch.nn.Module, arg: str, target_name: str | None) -> torch.nn.Module:
    """``oracle``: the target drafting for itself (every layer, shared weights). Its draft distribution is the
    target's, so its tau is the most a drafter can reach with a deterministic (top-ranked) tree policy and budget;
    sampled trees verified by speculative sampling accept every draft of such a drafter, so they are not bounded by
    it. Slow by design."""
    if arg:
        raise ValueError(f"'oracle' takes no argument (it is the whole target), got {arg!r}.")
    return truncated(model, model.config.get_text_config().num_hidden_layers)  # truncated() checks the layout


#: --drafter "<kind>[:<arg>]" -> factory(target model, arg, target name as given to --model or None); any other spec
#: is a checkpoint path or hub id
DRAFTER_FACTORIES: dict[str, Callable[[torch.nn.Module, str, str | None], torch.nn.Module]] = {
    "truncated": lambda model, arg, target_name: truncated(model, _whole_number(arg)),
    "lookup": lambda model, arg, target_name: prompt_lookup(model, max_ngram_size=_whole_number(arg, default=3)),
    "default": _default_drafter,
    "oracle": _oracle_drafter,
}


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_model(name_or_path: str, dtype: str, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, Any]:
    """The target (tree speculation enabled) on ``device`` and its tokenizer: a short asset name, a checkpoint folder
    or hub id."""
    from ..assets import load_target

    model, tokenizer = load_target(name_or_path, dtype=DTYPES[dtype])
    return enable(model.to(device)), tokenizer


def load_drafter(spec: str, model: torch.nn.Module, dtype: str, target_name: str | None = None) -> torch.nn.Module:
    """``truncated:k`` (the target's first k layers, no copy), ``oracle`` (the whole target: what a deterministic tree of
    that policy and budget can hold, not a bound on drafters in general), ``lookup[:n]``, ``default[:<target>]`` (the drafter
    shipped for ``target_name``, the name ``model`` was loaded from; without one, for SmolLM2-135M-Instruct), or a
    checkpoint path / hub id.

    A checkpoint whose config is a causal LM loads with ``AutoModelForCausalLM`` (``AutoModel`` would drop its LM
    head); anything else, e.g. a TreeSpec feature drafter registered with ``AutoModel``, loads with ``AutoModel``.
    """
    kind, _, arg = spec.partition(":")
    if kind in DRAFTER_FACTORIES:
        try:
            return DRAFTER_FACTORIES[kind](model, arg, target_name)
        except ValueError as error:
            raise ValueError(f"--drafter {spec!r}: {error}") from error
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(spec)
    loader = AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModel
    drafter = loader.from_pretrained(spec, dtype=DTYPES[dtype]).to(model.device).eval()
    if isinstance(drafter, TreeSpecDrafterModel):
        drafter.tie_to_target(model)  # a no-op unless the checkpoint left out the embeddings / LM head
    return drafter


def load_benchmark_questions(config: Any) -> list:
    """The first ``config.num_questions`` questions of a `BenchmarkConfig` (all of them when ``max_prompt_tokens``
    filters: the cap applies to the questions that fit)."""
    limit = None if config.max_prompt_tokens is not None else config.num_questions
    if config.questions is not None:
        from ..assets import load_questions

        return load_questions(config.questions, limit)
    return DATASETS[config.dataset](limit)


def fitting_prompts(questions: list, prompts: list[torch.Tensor], max_prompt_tokens: int | None,
                    limit: int | None) -> tuple[list, list[torch.Tensor]]:
    """The first ``limit`` (question, prompt) pairs whose prompt has at most ``max_prompt_tokens`` tokens: a rule
    fixed before any result, so long-context outliers (ShareGPT has 4k-token first turns) can be left out of a
    short-context comparison without picking questions by hand."""
    if max_prompt_tokens is None:
        return questions, prompts
    kept = [(q, p) for q, p in zip(questions, prompts) if p.shape[1] <= max_prompt_tokens][:limit]
    if not kept:
        raise ValueError(f"no question has a prompt of at most {max_prompt_tokens} tokens; raise --max-prompt-tokens.")
    return [q for q, _ in kept], [p for _, p in kept]


def build_prompt(tokenizer, question) -> torch.Tensor:
    """First turn as a chat prompt ending with the assistant header, ``[1, L]``."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template; the benchmark prompts instruct models through "
            "apply_chat_template. Use an instruct model's tokenizer or set tokenizer.chat_template."
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question.turns[0]}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError(f"question {question.question_id!r} tokenises to an empty prompt.")
    return ids
