"""Prefix-independent warpers run once over all tree rows; the result equals generate's per-node processing."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

from hf_treespec.generation.processors import is_prefix_independent, process_tree_logits
from hf_treespec.tree import DraftTree


def random_tree(vocab: int, seed: int = 0) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree.root(5)
    for _ in range(20):
        parent = torch.randint(0, tree.num_nodes, (1,), generator=g)
        tree = tree.add_children(parent, torch.randint(0, vocab, (1,), generator=g), torch.tensor([-0.5]))
    return tree


def per_node(processors, prefix, tree, logits):
    paths = tree.paths()
    rows = []
    for v in range(tree.num_nodes):
        d = int(tree.depth[v])
        ids = torch.cat([prefix, paths[v, 1 : d + 1][None]], 1)
        rows.append(processors(ids, logits[v : v + 1].clone()))
    return torch.cat(rows)


class CountsPrefix(LogitsProcessor):
    """A custom processor that reads the prefix: must stay per node (unknown classes default to per node)."""

    def __call__(self, input_ids, scores):
        return scores - 0.1 * input_ids.shape[1] - 0.01 * input_ids[:, -1:].float()


WARPER_SETS = {
    "temperature+top_p": [lp.TemperatureLogitsWarper(0.7), lp.TopPLogitsWarper(0.9)],
    "top_k+min_p": [lp.TopKLogitsWarper(20), lp.MinPLogitsWarper(0.05)],
    "typical+epsilon+eta": [lp.TypicalLogitsWarper(0.9), lp.EpsilonLogitsWarper(3e-4), lp.EtaLogitsWarper(3e-4)],
    "repetition+no_repeat+temperature+top_p": [
        lp.RepetitionPenaltyLogitsProcessor(1.3), lp.NoRepeatNGramLogitsProcessor(2),
        lp.TemperatureLogitsWarper(0.8), lp.TopPLogitsWarper(0.8)],
    "interleaved custom": [lp.TemperatureLogitsWarper(0.9), CountsPrefix(), lp.TopKLogitsWarper(30),
                           lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TopPLogitsWarper(0.95)],
}


@pytest.mark.parametrize("name", sorted(WARPER_SETS))
def test_batched_equals_per_node(name):
    vocab = 500
    processors = LogitsProcessorList(WARPER_SETS[name])
    tree = random_tree(vocab)
    torch.manual_seed(1)
    logits = torch.randn(tree.num_nodes, vocab) * 4
    prefix = torch.randint(0, vocab, (1, 30))
    prefix[0, -1] = 5
    raw = logits.clone()
    batched = process_tree_logits(processors, prefix, tree, torch.arange(tree.num_nodes), logits)
    assert torch.equal(logits, raw)  # raw logits untouched
    assert torch.equal(batched, per_node(processors, prefix, tree, logits))


def test_unknown_processors_are_per_node():
    assert is_prefix_independent(lp.TopPLogitsWarper(0.9))
    assert not is_prefix_independent(CountsPrefix())
    assert not is_prefix_independent(lp.RepetitionPenaltyLogitsProcessor(1.1))

    class MyTopP(lp.TopPLogitsWarper):  # a subclass might read the prefix: not trusted
        pass

    assert not is_prefix_independent(MyTopP(0.9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_min_length_processors_equal_transformers(dtype):
    """The min-length processors computed the fast way (`FAST_PROCESSORS`) give transformers' output exactly: below,
    at and above the length, EOS ids inside and outside the vocabulary, one row and several; a list mixing them with
    other processors too, and per tree node (`process_tree_logits`)."""
    from hf_treespec.generation.processors import FAST_PROCESSORS, run_processors

    vocab = 50
    scores = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)).to(dtype)
    processors = [lp.MinLengthLogitsProcessor(9, eos_token_id=[4, 7, vocab + 3]),
                  lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=3, eos_token_id=11)]
    assert {type(p) for p in processors} <= set(FAST_PROCESSORS)
    for length in range(5, 12):
        ids = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(length))
        for processor in processors:
            assert torch.equal(FAST_PROCESSORS[type(processor)](processor, ids, scores), processor(ids, scores))
        mixed = LogitsProcessorList([processors[0], lp.RepetitionPenaltyLogitsProcessor(1.3), processors[1]])
        assert torch.equal(run_processors(mixed, ids, scores), mixed(ids, scores))
    tree = random_tree(vocab, seed=2)
    prefix = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(4))
    logits = torch.randn(tree.num_nodes, vocab, generator=torch.Generator().manual_seed(5)).to(dtype)
    listed = LogitsProcessorList(processors)
    out = process_tree_logits(listed, prefix, tree, torch.arange(tree.num_nodes), logits)
    assert torch.equal(out, per_node(listed, prefix, tree, logits))


def test_node_rows_process_each_read_row_as_the_whole_tree_would():
    """`NodeRows` (the rows a top-down walk reads, processed on first read) gives each node the row that processing
    the whole tree gives, prefix-dependent processors included; a stacked read equals the tensor's rows, a row is
    processed once, and a node outside the tree is an error."""
    from hf_treespec.generation.processors import NodeRows

    vocab = 500
    processors = LogitsProcessorList(WARPER_SETS["interleaved custom"])
    tree = random_tree(vocab)
    logits = torch.randn(tree.num_nodes, vocab, generator=torch.Generator().manual_seed(2)) * 4
    prefix = torch.randint(0, vocab, (1, 30), generator=torch.Generator().manual_seed(3))
    whole = process_tree_logits(processors, prefix, tree, torch.arange(tree.num_nodes), logits)
    rows = NodeRows(processors, prefix, tree, logits)
    assert len(rows) == tree.num_nodes
    for node in (7, 0, 13, 7):
        assert torch.equal(rows[node], whole[node])
    assert rows[7] is rows[7]  # kept after the first read
    path = torch.tensor([0, 3, 7])
    assert torch.equal(rows[path], whole[path]) and torch.equal(rows[[0, 3, 7]], whole[path])
    with pytest.raises(IndexError, match="not in a tree of"):
        rows[tree.num_nodes]


@pytest.mark.parametrize("policy", ["dyspec", "iid"])
def test_visited_rows_decode_as_every_row(target, drafters, prompt, policy):
    """Sampling through a top-down verifier with the rows its walk reads processed on demand gives, at a seed, the
    tokens and scores of processing every tree row (the processors draw nothing): prefix-dependent processors and
    top-k over trees that were drafted."""
    from conftest import assert_drafted
    from hf_treespec.verifiers.topdown import TopDownVerifier

    kwargs = dict(assistant_model=drafters["perturbed"], do_sample=True, top_k=20, repetition_penalty=1.3,
                  temperature=0.9, max_new_tokens=20, return_dict_in_generate=True, output_scores=True)
    outs = {}
    for lazy in (True, False):
        torch.manual_seed(5)
        try:
            TopDownVerifier.reads_visited_rows = lazy
            outs[lazy] = (target.generate(prompt, tree_policy="dyspec", tree_budget=6, **kwargs) if policy == "dyspec"
                          else target.generate(prompt, tree_policy="iid", tree_paths=2, tree_depth=3, **kwargs))
        finally:
            TopDownVerifier.reads_visited_rows = True
    assert_drafted(outs[True])
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[True].scores, outs[False].scores))


class DtypeRecorder(LogitsProcessor):
    """Records the dtype of every score tensor it is handed; changes nothing."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append(scores.dtype)
        return scores


def bf16_pair(target, drafters):
    """bf16 copies of the tiny target and its perturbed drafter."""
    import copy

    return copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(drafters["perturbed"]).to(torch.bfloat16)


def decode_recording(generate, scores: bool) -> tuple:
    """``generate(**kwargs)`` at seed 5 with a `DtypeRecorder` as its processor, scores returned or not."""
    recorder = DtypeRecorder()
    torch.manual_seed(5)
    out = generate(logits_processor=LogitsProcessorList([recorder]), output_scores=scores, max_new_tokens=20,
                   return_dict_in_generate=True)
    return out, recorder


@pytest.mark.parametrize("policy, verifier", [("dyspec", "swor"), ("iid", "traversal"), ("salf", "greedy")])
def test_bf16_rows_reach_processors_in_fp32(target, drafters, prompt, policy, verifier):
    """A bf16 target's step logits stay bf16 unless returned, and every row generate's processors read is cast to
    fp32 first, as plain ``generate`` casts its last row: through the walk's visited rows (swor), every row at once
    (traversal) and greedy trees (salf); the same tokens with scores returned."""
    from conftest import assert_drafted

    model, drafter = bf16_pair(target, drafters)
    sampling = dict(do_sample=True, top_k=20, temperature=0.9) if verifier != "greedy" else dict(do_sample=False)
    kwargs = dict(assistant_model=drafter, verifier=verifier, **sampling)

    def generate(**more):
        if policy == "dyspec":
            return model.generate(prompt, tree_policy="dyspec", tree_budget=6, **kwargs, **more)
        if policy == "iid":
            return model.generate(prompt, tree_policy="iid", tree_paths=2, tree_depth=3, **kwargs, **more)
        return model.generate(prompt, tree_policy="salf", tree_budget=4, **kwargs, **more)

    (with_scores, _), (out, recorder) = decode_recording(generate, True), decode_recording(generate, False)
    assert_drafted(out)
    assert recorder.seen and set(recorder.seen) == {torch.float32}
    assert torch.equal(with_scores.sequences, out.sequences)


@pytest.mark.auto_budget
def test_bf16_draft_free_rows_reach_processors_in_fp32(target, drafters, prompt):
    """The same for the root-only rows of draft-free steps (``auto`` on this random pair drafts on few steps):
    processed as plain ``generate`` processes its row, in fp32."""
    model, drafter = bf16_pair(target, drafters)

    def generate(**more):
        return model.generate(prompt, assistant_model=drafter, tree_policy="salf", tree_budget="auto",
                              do_sample=False, **more)

    (with_scores, _), (out, recorder) = decode_recording(generate, True), decode_recording(generate, False)
    assert out.drafted_steps < len(out.accepted_lengths)  # draft-free steps ran
    assert recorder.seen and set(recorder.seen) == {torch.float32}
    assert torch.equal(with_scores.sequences, out.sequences)
