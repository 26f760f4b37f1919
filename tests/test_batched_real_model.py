"""A batch of 8 MT-bench prompts of different lengths on the real target (fp32, greedy), every policy with the shipped
drafter: each row equals that prompt's own plain ``generate``; with a custom EOS and with stop strings rows finish at
different steps and are padded as plain batched ``generate`` pads them."""

from __future__ import annotations

import pytest
import torch

import hf_treespec
from hf_treespec.assets import default_drafter, load_questions, load_target
from hf_treespec.benchmark.batched import left_pad

from conftest import assert_drafted, fixed_budget

POLICIES = ["chain", "eagle2", "optimal", "salf", "c2t", "dyspec", "static", "iid", "swor", "delayed", "nde"]
#: the policy the default test command checks here; the others (about a minute each on 2 cores) run under -m slow
DEFAULT_POLICY = "salf"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def setup():
    model, tok = load_target(dtype=torch.float32)
    model = hf_treespec.enable(model)
    prompts = []
    for question in load_questions(limit=8):
        ids = tok.apply_chat_template([{"role": "user", "content": question.turns[0]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        prompts.append(ids)
    assert len({p.shape[1] for p in prompts}) > 1, "the prompts must differ in length"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    singles = [model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False)[0, p.shape[1]:] for p in prompts]
    return model, tok, default_drafter(model), prompts, singles, int(pad)


@pytest.mark.real_model
@pytest.mark.parametrize("policy", [p if p == DEFAULT_POLICY else pytest.param(p, marks=pytest.mark.slow)
                                    for p in POLICIES])
def test_every_policy_rows_equal_single_prompt_generate(setup, policy):
    model, _, drafter, prompts, singles, pad = setup
    ids, mask = left_pad(prompts, pad)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad,
                         assistant_model=drafter, tree_policy=policy, return_dict_in_generate=True,
                         **fixed_budget(policy))  # trees on every step: auto may find none pays on this machine
    assert_drafted(out)
    for row, single in enumerate(singles):
        got = out.sequences[row, ids.shape[1]:]
        assert torch.equal(got[: single.numel()], single), (policy, row)
    steps = sum(len(r) for r in out.row_accepted_lengths)
    assert (sum(map(sum, out.row_accepted_lengths))) / steps > 1.0, "the drafter's trees are accepted"


@pytest.mark.real_model
@pytest.mark.slow
def test_custom_eos_and_stop_strings_finish_rows_at_different_steps(setup):
    model, tok, drafter, prompts, singles, pad = setup
    ids, mask = left_pad(prompts, pad)
    eos = int(singles[0][5])  # row 0 ends at its 6th token at the latest
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad, eos_token_id=eos)
    plain = model.generate(ids, attention_mask=mask, **kwargs)
    tree = model.generate(ids, attention_mask=mask, assistant_model=drafter, tree_policy="salf", tree_budget=60,
                          return_dict_in_generate=True, **kwargs)
    assert_drafted(tree)
    tree = tree.sequences
    assert torch.equal(tree, plain)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)[0, prompt.shape[1]:]
        assert torch.equal(tree[row, ids.shape[1]: ids.shape[1] + alone.numel()], alone), row
    stop = tok.decode(singles[1][8:10])
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad, stop_strings=[stop], tokenizer=tok)
    tree = model.generate(ids, attention_mask=mask, assistant_model=drafter, tree_policy="eagle2", tree_budget=60,
                          return_dict_in_generate=True, **kwargs)
    assert_drafted(tree)
    tree = tree.sequences
    lengths = set()
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)[0, prompt.shape[1]:]
        assert torch.equal(tree[row, ids.shape[1]: ids.shape[1] + alone.numel()], alone), row
        lengths.add(alone.numel())
    assert len(lengths) > 1
