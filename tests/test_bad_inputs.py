"""Bad input gets a clear error, never a silent fallback."""

import copy

import pytest
import torch

import hf_treespec
from conftest import tiny_llama


def gen(target, prompt, drafter, **kwargs):
    kwargs.setdefault("do_sample", False)
    return target.generate(prompt, max_new_tokens=5, assistant_model=drafter, **kwargs)


def test_drafter_with_other_vocabulary(target, prompt):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = copy.deepcopy(target.config)
    cfg.vocab_size = 80
    other = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "vocab_size": 80})).eval()
    with pytest.raises(ValueError, match="vocabulary .*80.* does not match .*64"):
        gen(target, prompt, other, tree_policy="salf", tree_budget=8)


def test_unknown_policy_lists_valid_ones(target, drafters, prompt):
    with pytest.raises(ValueError, match="Unknown tree policy 'beam'.*eagle2.*salf"):
        gen(target, prompt, drafters["copy"], tree_policy="beam")


def test_unknown_verifier_lists_valid_ones(target, drafters, prompt):
    with pytest.raises(ValueError, match="Unknown verifier 'magic'.*greedy.*nss"):
        gen(target, prompt, drafters["copy"], tree_policy="salf", tree_budget=8, verifier="magic", do_sample=True)


def test_verifier_not_lossless_for_deterministic_tree(target, drafters, prompt):
    with pytest.raises(ValueError, match="not lossless for the 'deterministic' drafting regime"):
        gen(target, prompt, drafters["copy"], tree_policy="eagle2", tree_budget=8, verifier="naive", do_sample=True)


def test_greedy_verifier_refused_when_sampling(target, drafters, prompt):
    with pytest.raises(ValueError, match="not lossless when sampling"):
        gen(target, prompt, drafters["copy"], tree_policy="salf", tree_budget=8, verifier="greedy", do_sample=True)


def test_sampling_verifier_refused_when_greedy(target, drafters, prompt):
    with pytest.raises(ValueError, match="do_sample=False use verifier='greedy'"):
        gen(target, prompt, drafters["copy"], tree_policy="salf", tree_budget=8, verifier="nss")


def test_chain_only_verifier_on_a_tree(target, drafters, prompt):
    from hf_treespec.verifiers import VERIFIERS

    with pytest.raises(ValueError, match="single chain"):
        VERIFIERS.get("naive").check_compatible("iid", is_chain=False, do_sample=True)


@pytest.mark.parametrize("kwarg", ["tree_budget", "tree_depth", "tree_topk"])
def test_zero_budget(target, drafters, prompt, kwarg):
    with pytest.raises(ValueError, match=f"{kwarg} must be >= 1"):
        params = {"tree_budget": 8, kwarg: 0}
        gen(target, prompt, drafters["copy"], tree_policy="eagle2", tree_budget=params.pop("tree_budget"), **params)


def test_kwarg_the_policy_does_not_use(target, drafters, prompt):
    with pytest.raises(ValueError, match="does not use \\['salf_threshold'\\]"):
        gen(target, prompt, drafters["copy"], tree_policy="eagle2", tree_budget=8, salf_threshold=0.5)


def test_bad_salf_threshold(target, drafters, prompt):
    with pytest.raises(ValueError, match="salf_threshold must be in"):
        gen(target, prompt, drafters["copy"], tree_policy="salf", tree_budget=8, salf_threshold=1.5)


def test_all_padding_prompt_row(target, drafters):
    ids = torch.randint(0, 64, (2, 5))
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match="all padding"):
        gen(target, ids, drafters["copy"], tree_policy="salf", tree_budget=8, attention_mask=mask, pad_token_id=0)


def test_empty_prompt(target, drafters):
    with pytest.raises(ValueError, match="non-empty prompt"):
        gen(target, torch.zeros(1, 0, dtype=torch.long), drafters["copy"], tree_policy="salf", tree_budget=8)


def test_missing_drafter(target, prompt):
    with pytest.raises(ValueError, match="tree_policy needs a drafter"):
        target.generate(prompt, max_new_tokens=5, tree_policy="salf", tree_budget=8)


def test_tree_kwargs_need_enable(prompt):
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match="tree_policy"):
        model.generate(prompt, max_new_tokens=3, tree_policy="salf", tree_budget=8, assistant_model=model)


def test_output_hidden_states_refused(target, drafters, prompt):
    with pytest.raises(ValueError, match="output_hidden_states"):
        gen(target, prompt, drafters["copy"], tree_policy="salf", tree_budget=8, return_dict_in_generate=True,
            output_hidden_states=True)


def test_flash_attention_target_is_switched_to_sdpa(prompt):
    """flash-attention-2 cannot express tree masks: the target is moved to sdpa (or refused with advice)."""
    from hf_treespec.attention import check_tree_attention

    model = tiny_llama(layers=1)
    model.config._attn_implementation = "flash_attention_2"
    check_tree_attention(model)
    assert model.config._attn_implementation == "sdpa"

    class NoSwitch(torch.nn.Module):
        config = type("C", (), {"_attn_implementation": "flash_attention_2"})()

    with pytest.raises(ValueError, match="cannot express tree attention masks"):
        check_tree_attention(NoSwitch())


def test_enable_is_idempotent_and_keeps_architecture_name(tmp_path):
    model = tiny_llama(layers=1)
    cls = type(model)
    hf_treespec.enable(model)
    first = type(model)
    hf_treespec.enable(model)
    assert type(model) is first and issubclass(first, cls)
    model.save_pretrained(tmp_path)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path).architectures == ["LlamaForCausalLM"]


def test_truncated_shares_weights(target):
    drafter = hf_treespec.drafters.truncated(target, num_layers=2)
    assert drafter.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert drafter.lm_head.weight is target.lm_head.weight
    assert len(drafter.model.layers) == 2 and drafter.model.layers[1] is target.model.layers[1]
    with pytest.raises(ValueError, match="num_layers must be between 1 and 4"):
        hf_treespec.drafters.truncated(target, num_layers=9)


def test_list_policies_and_verifiers():
    assert {"chain", "eagle2", "optimal", "salf"} <= set(hf_treespec.list_policies())
    assert {"greedy", "nss", "naive"} <= set(hf_treespec.list_verifiers())


@pytest.mark.parametrize("loop", ["tree", "plain"])
def test_a_filled_cache_is_refused(target, drafters, prompt, loop):
    """The loops feed the whole prompt: continuing from a ``past_key_values`` that holds tokens would feed them twice
    (it crashed in the attention before this check)."""
    first = target.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    extra = ({"assistant_model": drafters["perturbed"], "tree_policy": "salf", "tree_budget": 4} if loop == "tree"
             else {"custom_generate": hf_treespec.plain_generate})
    with pytest.raises(ValueError, match="already holds"):
        target.generate(first.sequences, max_new_tokens=3, do_sample=False, past_key_values=first.past_key_values,
                        **extra)
