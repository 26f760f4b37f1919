"""Greedy tree speculation must reproduce plain ``generate(do_sample=False)`` token for token (fp32)."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_treespec.compat import CACHE_KWARG, output_cache
from hf_treespec.drafters import as_drafter
from hf_treespec.tree import DraftTree

from conftest import assert_drafted, fixed_budget

POLICIES = ["chain", "eagle2", "optimal", "salf"]
DRAFTERS = ["random", "copy", "perturbed", "truncated"]


@pytest.mark.parametrize("drafter_name", DRAFTERS)
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_identity(target, drafters, prompt, policy, drafter_name):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=30)
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=30, assistant_model=drafters[drafter_name], tree_policy=policy,
        return_dict_in_generate=True, **fixed_budget(policy),
    )
    assert_drafted(out, accepting=drafter_name != "random")
    assert torch.equal(out.sequences, ref)
    assert sum(out.accepted_lengths) + 1 == ref.shape[1] - prompt.shape[1]


def test_copy_drafter_accepts_whole_chain(target, drafters, prompt):
    out = target.generate(prompt, do_sample=False, max_new_tokens=25, assistant_model=drafters["copy"],
                          tree_policy="chain", tree_depth=4, return_dict_in_generate=True)
    assert_drafted(out)
    assert out.accepted_lengths[:-1] == [5] * (len(out.accepted_lengths) - 1)


def test_perturbed_drafter_accepts_non_top1_branches(target, drafters):
    """The tree must pay off beyond the draft's top-1 chain, otherwise the tests above prove little."""
    torch.manual_seed(5)
    ids = torch.randint(0, 64, (1, 12))
    out = target.generate(ids, do_sample=False, max_new_tokens=60, assistant_model=drafters["perturbed"],
                          tree_policy="eagle2", tree_budget=30, return_dict_in_generate=True)
    chain = target.generate(ids, do_sample=False, max_new_tokens=60, assistant_model=drafters["perturbed"],
                            tree_policy="chain", tree_depth=7, return_dict_in_generate=True)
    assert_drafted(out)
    assert_drafted(chain)
    tau_tree = sum(out.accepted_lengths) / len(out.accepted_lengths)
    tau_chain = sum(chain.accepted_lengths) / len(chain.accepted_lengths)
    assert tau_tree > tau_chain


@pytest.mark.parametrize("policy", POLICIES)
def test_eos_inside_accepted_chunk(target, drafters, prompt, policy):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=30)
    gen = ref[0, prompt.shape[1] :].tolist()
    at = next(i for i in range(8, len(gen)) if gen[i] not in gen[:i])  # a token plain generate first emits there
    eos = gen[at]  # it must stop right there
    ref_eos = target.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=eos)
    out = target.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=eos,
                          assistant_model=drafters["copy"], tree_policy=policy, return_dict_in_generate=True,
                          **fixed_budget(policy))
    assert_drafted(out)
    assert torch.equal(out.sequences, ref_eos)
    assert int(out.sequences[0, -1]) == eos and out.sequences.shape[1] == prompt.shape[1] + at + 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_exact(target, drafters, prompt, max_new_tokens):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
    out = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                          assistant_model=drafters["copy"], tree_policy="salf", tree_budget=60)
    if max_new_tokens > 1:  # the prefill emits the first token: a tree needs a second one to draft for
        assert_drafted(out, accepting=max_new_tokens > 2)
    assert torch.equal(out.sequences, ref)


def test_repetition_penalty_and_no_repeat_ngram(target, drafters, prompt):
    kwargs = dict(do_sample=False, max_new_tokens=30, repetition_penalty=1.5, no_repeat_ngram_size=3)
    ref = target.generate(prompt, **kwargs)
    for policy in POLICIES:
        if policy == "nde":  # needs a trained selector: test_nde.py covers it
            continue
        out = target.generate(prompt, assistant_model=drafters["perturbed"], tree_policy=policy,
                              return_dict_in_generate=True, **fixed_budget(policy), **kwargs)
        assert_drafted(out)
        assert torch.equal(out.sequences, ref), policy


def test_stop_strings(target, drafters, prompt, word_tokenizer):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=30)
    stop = word_tokenizer.decode(ref[0, prompt.shape[1] + 6 : prompt.shape[1] + 8])
    kwargs = dict(do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=word_tokenizer)
    ref_stop = target.generate(prompt, **kwargs)
    out = target.generate(prompt, assistant_model=drafters["copy"], tree_policy="eagle2", tree_budget=60,
                          return_dict_in_generate=True, **kwargs)
    assert_drafted(out)
    out = out.sequences
    assert torch.equal(out, ref_stop)
    assert ref_stop.shape[1] < ref.shape[1]


def test_custom_stopping_criteria(target, drafters, prompt):
    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= prompt.shape[1] + 11, dtype=torch.bool)

    crit = StoppingCriteriaList([StopAtLength()])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=30, stopping_criteria=crit)
    out = target.generate(prompt, do_sample=False, max_new_tokens=30, stopping_criteria=crit,
                          assistant_model=drafters["copy"], tree_policy="salf", tree_budget=60,
                          return_dict_in_generate=True)
    assert_drafted(out)
    out = out.sequences
    assert torch.equal(out, ref) and out.shape[1] == prompt.shape[1] + 11


def test_scores_and_logits_match_plain(target, drafters, prompt):
    kwargs = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.2)
    ref = target.generate(prompt, **kwargs)
    out = target.generate(prompt, assistant_model=drafters["perturbed"], tree_policy="eagle2", tree_budget=60,
                          **kwargs)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_outputs_leave_inference_mode(target, drafters, prompt):
    """The loop runs under torch.inference_mode, but what it returns is ordinary: the sequences can be scored with
    gradients (an RL loop's next step), and generation continues from the returned cache."""
    out = target.generate(prompt, assistant_model=drafters["perturbed"], tree_policy="eagle2", tree_budget=20,
                          do_sample=False, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    assert not out.sequences.is_inference() and not any(s.is_inference() for s in out.scores)
    ids = target.generate(prompt, assistant_model=drafters["perturbed"], tree_policy="salf", tree_budget=20,
                          max_new_tokens=4)
    assert not ids.is_inference()
    with torch.enable_grad():
        loss = target(out.sequences).logits.logsumexp(-1).mean()
        loss.backward()
    assert target.model.embed_tokens.weight.grad is not None
    target.zero_grad(set_to_none=True)
    plain = target.generate(out.sequences, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: output_cache(out)})
    assert torch.equal(plain, target.generate(out.sequences, max_new_tokens=4, do_sample=False))


def test_streamer_receives_every_token(target, drafters, prompt, word_tokenizer):
    class Collect:
        def __init__(self):
            self.chunks = []
            self.ended = False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, streamer=streamer,
                          assistant_model=drafters["copy"], tree_policy="salf", tree_budget=60,
                          return_dict_in_generate=True)
    assert_drafted(out)
    streamed = [t for chunk in streamer.chunks for t in chunk]
    assert streamed == out.sequences[0].tolist() and streamer.ended
    assert max(len(chunk) for chunk in streamer.chunks[1:]) > 1  # accepted chunks stream whole


def test_without_tree_policy_generate_is_stock(target, drafters, prompt):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    assisted = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"])
    assert torch.equal(assisted, ref)
    assert not hasattr(target.generate(prompt, max_new_tokens=3, return_dict_in_generate=True), "accepted_lengths")


def test_generation_config_round_trip(target, tmp_path):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=8)
    config.tree_policy, config.tree_budget, config.salf_threshold = "salf", 16, 0.5
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert (loaded.tree_policy, loaded.tree_budget, loaded.salf_threshold) == ("salf", 16, 0.5)


def test_tree_kwargs_from_model_generation_config(target, drafters, prompt):
    import copy

    model = copy.deepcopy(target)
    model.generation_config.tree_policy = "eagle2"
    model.generation_config.tree_budget = 10
    ref = target.generate(prompt, do_sample=False, max_new_tokens=15)
    out = model.generate(prompt, do_sample=False, max_new_tokens=15, assistant_model=drafters["copy"],
                         return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref) and max(out.tree_sizes) <= 10


def _paths_logits(model, prefix, tree):
    """From-scratch logits after every node: the prefix + the node's path, no cache, no tree mask."""
    rows = []
    for v in range(tree.num_nodes):
        path = tree.tokens[tree.path_to(v)]
        ids = torch.cat([prefix, path])[None]
        rows.append(model(ids).logits[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def test_drafter_tree_attention_matches_from_scratch(target):
    """Expanding nodes over several calls (with pruning in between) equals recomputing every path from scratch."""
    drafter = as_drafter(target)
    prefix = torch.randint(0, 64, (9,))
    drafter.start(prefix[:-1])  # the whole prefix is still pending when the first tree is expanded
    tree = DraftTree.root(int(prefix[-1]))
    tree_prefix = prefix[:-1]
    # feed pending + root, then two levels, pruning a branch in between (indices change, uids do not)
    got = {}
    out = drafter.expand(tree, torch.tensor([0]))
    tree = tree.add_children(torch.tensor([0, 0, 0]), torch.tensor([5, 6, 7]), torch.zeros(3))
    got[int(tree.uids[0])] = out[0]
    out = drafter.expand(tree, torch.tensor([1, 3]))
    got.update({int(tree.uids[1]): out[0], int(tree.uids[3]): out[1]})
    tree = tree.add_children(torch.tensor([1, 3, 3]), torch.tensor([8, 9, 10]), torch.zeros(3))
    tree = tree.select(torch.tensor([0, 1, 3, 4, 5, 6]))  # drop node 2 (token 6)
    out = drafter.expand(tree, torch.tensor([3, 4, 5]))
    got.update({int(tree.uids[i]): out[j] for j, i in enumerate([3, 4, 5])})
    ref = _paths_logits(target, tree_prefix, tree)
    for i in range(tree.num_nodes):
        torch.testing.assert_close(got[int(tree.uids[i])], ref[i], atol=1e-4, rtol=1e-4)
    # commit the path root -> token 7 -> token 9 (the leaf was expanded); next step's root expansion still matches
    accepted = torch.tensor([0, 2, 4])
    committed = torch.cat([tree_prefix, tree.tokens[accepted]])
    drafter.commit(tree, accepted)
    nxt = DraftTree.root(33)
    out = drafter.expand(nxt, torch.tensor([0]))
    torch.testing.assert_close(out[0], target(torch.cat([committed, torch.tensor([33])])[None]).logits[0, -1],
                               atol=1e-4, rtol=1e-4)



def test_prompt_lookup_drafter_proposes_continuations_and_stays_exact(target):
    from hf_treespec.drafters import prompt_lookup

    drafter = prompt_lookup(target, max_ngram_size=2)
    drafter.start(torch.tensor([1, 2, 3, 9, 2, 3, 7, 2]))
    tree = DraftTree.root(3)  # suffix (2, 3) was followed by 9 and by 7; (3) alone also by 9 and 7
    logits = drafter.expand(tree, torch.tensor([0]))[0]
    assert set(torch.isfinite(logits).nonzero().squeeze(-1).tolist()) == {7, 9}
    tree = tree.add_children(torch.tensor([0]), torch.tensor([5]), torch.zeros(1))  # path ... 2 3 5: no match
    assert not torch.isfinite(drafter.expand(tree, torch.tensor([1]))).any()

    torch.manual_seed(3)
    ids = torch.randint(0, 64, (1, 40))
    ref = target.generate(ids, do_sample=False, max_new_tokens=40)
    for policy in POLICIES:
        if policy == "nde":  # needs a trained selector: test_nde.py covers it
            continue
        out = target.generate(ids, do_sample=False, max_new_tokens=40, assistant_model=prompt_lookup(target),
                              tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy))
        assert_drafted(out)  # the tiny model repeats itself: lookup drafts get accepted
        assert torch.equal(out.sequences, ref), policy
