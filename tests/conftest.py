"""Tiny random-weight models shared by the unit tests (fast: a few ms per forward)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_treespec

VOCAB = 64

# Tiny models are dispatch-bound: one thread avoids thread-pool overhead (and contention on 2-core CI machines).
torch.set_num_threads(1)


def fixed_budget(policy: str, nodes: int = 60) -> dict:
    """``tree_budget=nodes`` for a policy whose default is ``"auto"`` (trees sized by this machine's measured cost,
    so which steps draft varies run to run), nothing for the others: a test that counts drafts or compares seeded
    runs pins the size."""
    from hf_treespec.policies import POLICIES

    return {"tree_budget": nodes} if POLICIES.get(policy).defaults.get("tree_budget") == "auto" else {}


def confident_classifier(confidence: float = 0.9):
    """A C2T classifier that keeps every candidate (constant ``confidence`` above the default threshold 0.5): a c2t
    tree that drafts whatever the weights' random initialisation, where an untrained classifier may prune every
    candidate and leave the test decoding plainly."""
    from hf_treespec.policies.c2t import C2TClassifier

    classifier = C2TClassifier()
    with torch.no_grad():
        last = classifier.net[-1]
        last.weight.zero_()
        last.bias.fill_(float(torch.logit(torch.tensor(confidence))))
    return classifier


def _forget_speed_models(value, seen: set) -> None:
    """Drops what a model fixture learnt about step costs (models nested in dicts / tuples included)."""
    from hf_treespec.cost import forget_speed_models

    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.nn.Module):
        forget_speed_models(value)
    elif isinstance(value, dict):
        for item in value.values():
            _forget_speed_models(item, seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _forget_speed_models(item, seen)


@pytest.fixture(scope="session", autouse=True)
def session_compiled_cache(tmp_path_factory):
    """Compiled packages and exported IRs go to a folder of the test session (``HF_TREESPEC_COMPILED_CACHE``), not
    to the user's cache: the first test that compiles a graph builds its package, later ones load it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TREESPEC_COMPILED_CACHE", str(tmp_path_factory.mktemp("compiled-cache")))
        yield


@pytest.fixture(autouse=True)
def fresh_cost_state(request, tmp_path_factory, monkeypatch):
    """Every test measures costs from scratch: a fresh cost-curve cache (``HF_TREESPEC_COST_CACHE``), and the speed
    models its model fixtures learnt are dropped before and after it, so no test's trees depend on which tests ran
    before it on the same worker, or on curves another run left in ``~/.cache``."""
    monkeypatch.setenv("HF_TREESPEC_COST_CACHE", str(tmp_path_factory.mktemp("cost-cache")))
    seen: set = set()
    for value in request.node.funcargs.values():
        _forget_speed_models(value, seen)
    yield
    seen.clear()
    for value in request.node.funcargs.values():
        _forget_speed_models(value, seen)


def assert_drafted(out, accepting: bool = True) -> None:
    """Proves trees ran in a tree-speculative ``generate`` (``return_dict_in_generate=True``; a list of outputs is
    summed): some step verified draft nodes, and with a drafter that accepts, some step committed more than one
    token. A test of identity or of a sampled law that passes without it proves nothing about trees."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    drafted = sum(o.drafted_steps for o in outs)
    assert drafted > 0, "no step drafted a tree: the test ran plain decoding only"
    if accepting:
        assert max(max(o.accepted_lengths, default=0) for o in outs) > 1, "trees were drafted but never accepted"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (minutes of compiling or real-model decoding) run only when ``-m`` names them
    (``-m slow``, ``-m "slow or not slow"``) or the command line names the test itself (``file.py::test``), so the
    default command stays short; CI runs both sets."""
    if re.search(r"\bslow\b", config.getoption("markexpr") or ""):
        return
    named = [arg.replace("\\", "/") for arg in config.args if "::" in arg]
    skipped = [item for item in items if item.get_closest_marker("slow")
               and not any(item.nodeid.startswith(arg) or arg.endswith(item.nodeid) for arg in named)]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if item not in skipped]


def tiny_llama(seed: int = 0, layers: int = 4, sharpen: float = 12.0) -> LlamaForCausalLM:
    """A 4-layer random Llama; the LM head is scaled so distributions are peaked like a real LM's."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def perturbed_copy(model: torch.nn.Module, scale: float = 0.3, seed: int = 1) -> torch.nn.Module:
    """A drafter close to the target (any family): accepts often, but not always along the draft's top-1 branch."""
    drafter = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return drafter


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return hf_treespec.enable(tiny_llama())


@pytest.fixture(scope="session")
def drafters(target) -> dict[str, torch.nn.Module]:
    """Several drafters: unrelated random, exact copy, perturbed copy, truncated self-drafter."""
    return {
        "random": tiny_llama(seed=7, layers=2),
        "copy": copy.deepcopy(target),
        "perturbed": perturbed_copy(target),
        "truncated": hf_treespec.drafters.truncated(target, num_layers=2),
    }


def char_tokenizer(chars: str, chat: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (token i <-> ``chars[i]``); with ``chat``, padding and a minimal chat template
    (``U+question/A+``) so trainer data can be prepared from conversations."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a", pad_token="a")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] | upper }}+{{ m['content'] }}/{% endfor %}"
                               "{% if add_generation_prompt %}A+{% endif %}")
    return tokenizer


@pytest.fixture(scope="session")
def word_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the tiny vocabulary (token i <-> one character), usable by stop strings."""
    import string

    return char_tokenizer((string.ascii_letters + string.digits + "+/")[:VOCAB])


@pytest.fixture
def prompt() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randint(0, VOCAB, (1, 12))


def train_cli(target_dir, capsys):
    """``run(*argv)``: ``hf-treespec train <argv> --target <target_dir> --no-progress`` in-process; asserts exit 0 and
    returns the JSON summary the subcommand prints last."""
    import argparse
    import json

    from hf_treespec.trainers.cli import add_parser

    parser = argparse.ArgumentParser(prog="hf-treespec")
    add_parser(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> dict:
        args = parser.parse_args(["train", *argv, "--target", str(target_dir), "--no-progress"])
        assert args.handler(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    return run
