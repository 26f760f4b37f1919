"""The public entry point: ``generate(custom_generate=tree_generate)`` on a stock model, ``enable`` built on it, and
feature drafters attached to the target just by passing them as ``assistant_model``."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch

from transformers import AutoModel, GenerationConfig, LlamaForCausalLM

import hf_treespec
from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel
from hf_treespec.generation import is_enabled, tree_generate

from conftest import VOCAB, assert_drafted, confident_classifier, fixed_budget, perturbed_copy, tiny_llama

# nde needs a trained selector (covered through custom_generate below with a fixed one)
GREEDY_POLICIES = [p for p in hf_treespec.list_policies() if p != "nde"]


@pytest.fixture(scope="module")
def stock() -> LlamaForCausalLM:
    """A model hf_treespec never touched (no enable): stock class, stock generation config."""
    return tiny_llama()


@pytest.fixture(scope="module")
def stock_drafter(stock) -> LlamaForCausalLM:
    return perturbed_copy(stock)


@pytest.mark.parametrize("policy", GREEDY_POLICIES)
def test_stock_model_custom_generate_is_greedy_identical(stock, stock_drafter, prompt, policy):
    ref = stock.generate(prompt, do_sample=False, max_new_tokens=25)
    extra = {"c2t": dict(c2t_classifier=confident_classifier())}.get(policy, {})  # c2t needs a classifier
    out = stock.generate(prompt, do_sample=False, max_new_tokens=25, custom_generate=tree_generate,
                         tree_drafter=stock_drafter, tree_policy=policy, return_dict_in_generate=True, **extra,
                         **fixed_budget(policy))
    assert_drafted(out)  # per policy: `tree_sizes` alone is truthy when every step was draft-free
    assert torch.equal(out.sequences, ref)
    assert sum(out.accepted_lengths) + 1 == 25
    assert type(stock) is LlamaForCausalLM and not is_enabled(stock)
    assert not hasattr(stock.generation_config, "tree_policy")  # the call's kwargs stay on the call's config copy


def test_stock_model_nde_with_a_selector(stock, stock_drafter, prompt):
    from test_nde import ACTIONS, fixed_selector

    ref = stock.generate(prompt, do_sample=False, max_new_tokens=20)
    out = stock.generate(prompt, do_sample=False, max_new_tokens=20, custom_generate=tree_generate,
                         tree_drafter=stock_drafter, tree_policy="nde", tree_selector=fixed_selector(ACTIONS, 2),
                         return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)


def test_stock_model_reads_tree_kwargs_from_a_saved_generation_config(stock, stock_drafter, prompt, tmp_path):
    config = GenerationConfig(do_sample=False, max_new_tokens=15, tree_policy="eagle2", tree_budget=6)
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    ref = stock.generate(prompt, do_sample=False, max_new_tokens=15)
    out = stock.generate(prompt, generation_config=loaded, custom_generate=tree_generate,
                         tree_drafter=stock_drafter, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref) and max(out.tree_sizes) <= 6

    model = copy.deepcopy(stock)
    model.generation_config.tree_policy, model.generation_config.tree_budget = "salf", 5
    out = model.generate(prompt, do_sample=False, max_new_tokens=15, custom_generate=tree_generate,
                         tree_drafter=stock_drafter, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref) and max(out.tree_sizes) <= 5


def test_stock_model_streamer_gets_prompt_and_every_token(stock, stock_drafter, prompt):
    streamer = Collect()
    out = stock.generate(prompt, do_sample=False, max_new_tokens=12, custom_generate=tree_generate,
                         tree_drafter=stock_drafter, tree_policy="salf", tree_budget=20, tree_streamer=streamer,
                         return_dict_in_generate=True)
    assert_drafted(out)
    assert streamer.tokens == out.sequences[0].tolist() and streamer.ended
    enabled = hf_treespec.enable(copy.deepcopy(stock))
    streamer = Collect()
    out = enabled.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=stock_drafter,
                           tree_policy="salf", tree_budget=20, streamer=streamer, return_dict_in_generate=True)
    assert_drafted(out)
    assert streamer.tokens == out.sequences[0].tolist() and streamer.ended


REPOSITORY = Path(__file__).resolve().parents[1]  # holds custom_generate/generate.py + requirements.txt


class Collect:
    """A streamer that records what it is given."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.reshape(-1).tolist()

    def end(self):
        self.ended = True


def test_hub_layout_folder_binds_like_enable(stock, stock_drafter, prompt):
    """custom_generate=<the repository's path>: transformers loads custom_generate/generate.py as remote code and
    hands it every generate argument; it binds assistant_model and streamer with the same `bind_drafter` as enable,
    so transformers' assisted mode never sees the drafter (num_return_sequences > 1 runs)."""
    streamer = Collect()
    ref = stock.generate(prompt, do_sample=False, max_new_tokens=14)
    out = stock.generate(prompt, do_sample=False, max_new_tokens=14, custom_generate=str(REPOSITORY),
                         trust_remote_code=True, assistant_model=stock_drafter, tree_policy="salf", tree_budget=6,
                         streamer=streamer, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    assert streamer.tokens == out.sequences[0].tolist() and streamer.ended
    torch.manual_seed(0)
    samples = stock.generate(prompt, do_sample=True, max_new_tokens=6, num_return_sequences=2,
                             custom_generate=str(REPOSITORY), trust_remote_code=True, assistant_model=stock_drafter,
                             tree_policy="iid")
    assert samples.shape == (2, prompt.shape[1] + 6)
    with pytest.raises(ValueError, match="tree_policy needs a drafter: pass assistant_model="):
        stock.generate(prompt, max_new_tokens=4, custom_generate=str(REPOSITORY), trust_remote_code=True,
                       tree_policy="salf", tree_budget=6)


def test_bind_drafter_is_the_one_rule(word_tokenizer):
    """`bind_drafter` moves assistant_model / streamer to the names tree_generate declares, turns stop strings into
    a criterion, leaves everything else, never modifies its input, and refuses a drafter named twice."""
    from transformers import StopStringCriteria

    from hf_treespec.generation.binding import DRAFTER_KWARG, STREAMER_KWARG, bind_drafter

    model = tiny_llama(layers=1)
    drafter, streamer = object(), object()
    given = dict(assistant_model=drafter, streamer=streamer, tree_policy="salf", tree_budget=8, max_new_tokens=3)
    bound = bind_drafter(model, given)
    assert bound == {DRAFTER_KWARG: drafter, STREAMER_KWARG: streamer, "tree_policy": "salf", "tree_budget": 8,
                     "max_new_tokens": 3}
    assert "assistant_model" in given  # the caller's dict is untouched
    assert {DRAFTER_KWARG, STREAMER_KWARG} <= set(inspect.signature(tree_generate).parameters)
    with_stops = bind_drafter(model, dict(stop_strings=["ab"], tokenizer=word_tokenizer))
    assert with_stops["stop_strings"] is None and "tokenizer" not in with_stops
    assert isinstance(with_stops["stopping_criteria"][-1], StopStringCriteria)
    with pytest.raises(ValueError, match="pass assistant_model= or tree_drafter=, not both"):
        bind_drafter(model, dict(assistant_model=drafter, tree_drafter=drafter))


def test_no_caller_frame_is_read():
    """The drafter reaches the loop by name only: no module of the package inspects a caller's stack frame."""
    package = Path(hf_treespec.__file__).parent
    readers = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
               if "_getframe" in path.read_text() or "f_locals" in path.read_text()]
    assert not readers


def test_stock_model_sampling_runs_with_the_policy_default_verifier(stock, stock_drafter, prompt):
    torch.manual_seed(0)
    out = stock.generate(prompt, do_sample=True, temperature=0.8, max_new_tokens=10, custom_generate=tree_generate,
                         tree_drafter=stock_drafter, tree_policy="iid", return_dict_in_generate=True)
    assert_drafted(out)
    assert out.sequences.shape[1] == prompt.shape[1] + 10
    samples = stock.generate(prompt, do_sample=True, max_new_tokens=6, num_return_sequences=2,
                             custom_generate=tree_generate, tree_drafter=stock_drafter, tree_policy="iid")
    assert samples.shape == (2, prompt.shape[1] + 6)  # transformers' assisted mode (which refuses it) never runs


def test_custom_generate_errors_are_clear(stock, stock_drafter, prompt):
    kwargs = dict(max_new_tokens=5, custom_generate=tree_generate)
    with pytest.raises(ValueError, match="needs tree_policy=.*salf"):
        stock.generate(prompt, tree_drafter=stock_drafter, **kwargs)
    with pytest.raises(ValueError, match="tree_policy needs a drafter"):
        stock.generate(prompt, tree_policy="salf", tree_budget=8, **kwargs)
    # transformers never hands assistant_model to a callable: the error names the kwarg that reaches the loop
    with pytest.raises(ValueError, match="or tree_drafter= \\(with custom_generate=hf_treespec.tree_generate"):
        stock.generate(prompt, tree_policy="salf", tree_budget=8, assistant_model=stock_drafter, **kwargs)
    with pytest.raises(ValueError, match="left padding"):
        stock.generate(prompt.repeat(2, 1), attention_mask=torch.tensor([[1] * prompt.shape[1], [1, 1] + [0] * (
            prompt.shape[1] - 2)]), tree_drafter=stock_drafter, tree_policy="salf", tree_budget=8, pad_token_id=0,
            **kwargs)
    with pytest.raises(ValueError, match="Unknown.*'nope'.*salf"):
        stock.generate(prompt, tree_drafter=stock_drafter, tree_policy="nope", **kwargs)
    with pytest.raises(ValueError, match="tree_budget"):
        stock.generate(prompt, tree_drafter=stock_drafter, tree_policy="salf", tree_budget=0, **kwargs)


def test_stock_generate_without_custom_generate_still_rejects_tree_kwargs(stock, stock_drafter, prompt):
    with pytest.raises(ValueError, match="tree_policy"):
        stock.generate(prompt, max_new_tokens=3, tree_policy="salf", tree_budget=8, assistant_model=stock_drafter)


# ----------------------------------------------------------------------------------------------------- enable
def test_enable_is_sugar_over_custom_generate(prompt, tmp_path):
    model = tiny_llama(layers=2)
    drafter = perturbed_copy(model)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=15)
    assert hf_treespec.enable(model) is model and hf_treespec.enable(model) is model
    assert type(model) is LlamaForCausalLM and is_enabled(model)
    out = model.generate(prompt, do_sample=False, max_new_tokens=15, assistant_model=drafter, tree_policy="optimal",
                         tree_budget=20, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    # without tree_policy: stock generate, stock assisted generation included
    assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=15, assistant_model=drafter), ref)
    # a deep copy stays enabled and generates with its own weights
    clone = copy.deepcopy(model)
    assert is_enabled(clone) and clone.generate.__self__ is clone
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert not is_enabled(reloaded)


def test_enable_refuses_non_generative_modules():
    with pytest.raises(TypeError, match="generative model"):
        hf_treespec.enable(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------- attach without ceremony
def shared_drafter(target, tmp_path, **overrides) -> TreeSpecDrafterModel:
    """A feature drafter saved without the target's embeddings / LM head, loaded back untied."""
    torch.manual_seed(0)
    drafter = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(target.config, **overrides)).eval()
    drafter.tie_to_target(target, embeddings=True, lm_head=True).save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert not loaded.is_attached
    return loaded


def test_feature_drafter_is_tied_by_passing_it_as_assistant(stock, prompt, tmp_path):
    drafter = shared_drafter(stock, tmp_path, target_layers=[1, -1])
    ref = stock.generate(prompt, do_sample=False, max_new_tokens=12)
    out = stock.generate(prompt, do_sample=False, max_new_tokens=12, custom_generate=tree_generate,
                         tree_drafter=drafter, tree_policy="eagle2", tree_budget=8, return_dict_in_generate=True)
    assert_drafted(out, accepting=False)  # an untrained feature drafter
    assert torch.equal(out.sequences, ref)
    assert drafter.is_attached and drafter.get_input_embeddings() is stock.get_input_embeddings()
    assert drafter.get_output_embeddings() is stock.get_output_embeddings()


def test_feature_drafter_for_another_target_is_refused(stock, prompt, tmp_path):
    wider = LlamaForCausalLM(type(stock.config)(**{**stock.config.to_dict(), "hidden_size": 64})).eval()
    drafter = shared_drafter(wider, tmp_path / "wide")
    with pytest.raises(ValueError, match="not built for this target.*target_hidden_size 64 vs the target's "
                                         "hidden_size 32"):
        stock.generate(prompt, max_new_tokens=4, custom_generate=tree_generate, tree_drafter=drafter,
                       tree_policy="salf", tree_budget=8)
    bigger = LlamaForCausalLM(type(stock.config)(**{**stock.config.to_dict(), "vocab_size": VOCAB + 8})).eval()
    drafter = shared_drafter(bigger, tmp_path / "vocab")
    with pytest.raises(ValueError, match=f"vocabulary {VOCAB + 8} tokens vs the target's {VOCAB}"):
        stock.generate(prompt, max_new_tokens=4, custom_generate=tree_generate, tree_drafter=drafter,
                       tree_policy="salf", tree_budget=8)
    deep = tiny_llama(layers=6)
    drafter = shared_drafter(deep, tmp_path / "deep", target_layers=[5, -1])
    with pytest.raises(ValueError, match=r"target_layers \[5\] outside the target's 4 layers"):
        stock.generate(prompt, max_new_tokens=4, custom_generate=tree_generate, tree_drafter=drafter,
                       tree_policy="salf", tree_budget=8)


def test_tree_kwargs_are_the_policies_declared_ones():
    """The generate kwargs come from the policies' own ``defaults``: none is missing, none is left over."""
    from hf_treespec.generation.config import KWARG_DOCS, TREE_GENERATION_KWARGS
    from hf_treespec.policies import POLICIES

    declared = {key for name in POLICIES for key in POLICIES.get(name).defaults}
    assert set(TREE_GENERATION_KWARGS) == declared | {"tree_policy", "verifier"} == set(KWARG_DOCS)
