"""Prompt-lookup drafter: its n-gram index, sparse / whole-chain fast paths, greedy identity through generate."""

from collections import Counter

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_treespec.drafters import prompt_lookup
from hf_treespec.generation.draft_source import WarpedDraftSource
from hf_treespec.policies import POLICIES, DraftSource, StepContext
from hf_treespec.policies.base import answer_from, draft_greedy_chain, topk_children
from hf_treespec.tree import DraftTree
from hf_treespec.verifiers.greedy import GreedyVerifier

from conftest import assert_drafted, fixed_budget


class _Config:
    def get_text_config(self):
        return self

    vocab_size = 8


class _Model:
    config = _Config()


def reference_continuations(context: list[int], path: list[int], max_n: int, min_n: int = 1) -> Counter:
    """The rule by brute force: what followed the longest suffix of context + path (root first) in context + root."""
    seq, haystack = context + path, context + path[:1]
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        suffix = seq[-n:]
        seen = Counter(haystack[i + n] for i in range(len(haystack) - n) if haystack[i : i + n] == suffix)
        if seen:
            return seen
    return Counter()


def random_tree(root: int, generator: torch.Generator, levels: int = 3, width: int = 3) -> DraftTree:
    tree = DraftTree.root(root)
    frontier = torch.zeros(1, dtype=torch.long)
    for _ in range(levels):
        parents = frontier.repeat_interleave(width)
        tokens = torch.randint(0, _Config.vocab_size, (parents.numel(),), generator=generator)
        start = tree.num_nodes
        tree = tree.add_children(parents, tokens, torch.zeros(parents.numel()))
        frontier = torch.arange(start, tree.num_nodes)[:4]
    return tree


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    return tree.tokens[tree.path_to(node)].tolist()


class LogprobsOnly(DraftSource):
    """A draft source without the fast paths: policies must fall back to dense rows."""

    def __init__(self, source):
        self.source = source

    def logprobs(self, tree, nodes):
        return self.source.logprobs(tree, nodes)


@pytest.mark.parametrize("max_n", [1, 2, 3])
def test_expand_matches_brute_force_through_steps(max_n):
    gen = torch.Generator().manual_seed(max_n)
    context = torch.randint(0, _Config.vocab_size, (30,), generator=gen).tolist()
    drafter = prompt_lookup(_Model(), max_ngram_size=max_n)
    drafter.start(torch.tensor(context))
    for _ in range(4):  # several steps: the index grows by each committed path
        tree = random_tree(int(torch.randint(0, _Config.vocab_size, (1,), generator=gen)), gen)
        tree = tree.select(torch.tensor([0, 1, 2, 4, 5, 7, 13, 14, 16]))  # pruned trees keep working
        nodes = torch.arange(tree.num_nodes)
        scores = drafter.expand(tree, nodes)
        for node in range(tree.num_nodes):
            ref = reference_continuations(context, path_tokens(tree, node), max_n)
            got = {t: float(scores[node, t].exp()) for t in torch.isfinite(scores[node]).nonzero().squeeze(-1).tolist()}
            assert got == pytest.approx({t: float(c) for t, c in ref.items()}), node
        accepted = tree.path_to(tree.num_nodes - 1)
        drafter.commit(tree, accepted)
        context += tree.tokens[accepted].tolist()
        assert drafter.context.tolist() == context


def test_short_context_and_unseen_suffix():
    drafter = prompt_lookup(_Model(), max_ngram_size=3)
    drafter.start(torch.tensor([4]))
    assert not torch.isfinite(drafter.expand(DraftTree.root(5), torch.tensor([0]))).any()
    tree = DraftTree.root(4)  # the context [4] followed by the root 4: "4" -> 4
    assert torch.isfinite(drafter.expand(tree, torch.tensor([0]))[0]).nonzero().squeeze(-1).tolist() == [4]
    # nothing to propose: empty sparse rows, and every policy returns the bare root
    values, tokens = drafter.topk_logprobs(DraftTree.root(5), torch.tensor([0]), 4)
    assert values.shape == tokens.shape == (1, 0)
    source = WarpedDraftSource(drafter, LogitsProcessorList(), torch.tensor([[4, 5]]))
    for policy in ("chain", "optimal", "salf", "eagle2"):
        assert POLICIES.get(policy)(**fixed_budget(policy)).build(source, 5, context=StepContext(5)).num_nodes == 1, \
            policy


@pytest.mark.parametrize("k", [1, 2, 9])
def test_topk_logprobs_equals_log_softmax_of_expand(k):
    gen = torch.Generator().manual_seed(k)
    drafter = prompt_lookup(_Model(), max_ngram_size=2)
    drafter.start(torch.randint(0, _Config.vocab_size, (40,), generator=gen))
    tree = random_tree(3, gen)
    nodes = torch.arange(tree.num_nodes)
    dense = drafter.expand(tree, nodes).log_softmax(-1)
    values, tokens = drafter.topk_logprobs(tree, nodes, k)
    assert values.shape[1] <= k
    for row in range(tree.num_nodes):
        finite = torch.isfinite(values[row])
        proposed = torch.isfinite(dense[row]).nonzero().squeeze(-1).tolist()
        ranked = sorted((-float(dense[row, t]), t) for t in proposed)
        expected = ranked[: int(finite.sum())]
        assert int(finite.sum()) == min(k, len(ranked))
        assert tokens[row, finite].tolist() == [t for _, t in expected]  # best first, ties to the lower id
        torch.testing.assert_close(values[row, finite], dense[row, tokens[row, finite]])


@pytest.mark.parametrize("min_n", [1, 2])
def test_greedy_chain_equals_depth_by_depth_expansion(min_n):
    gen = torch.Generator().manual_seed(min_n)
    lengths = Counter()
    for trial in range(30):
        prefix = torch.randint(0, _Config.vocab_size, (int(torch.randint(2, 30, (1,), generator=gen)),), generator=gen)
        drafter = prompt_lookup(_Model(), max_ngram_size=3, min_ngram_size=min_n)
        drafter.start(prefix)
        source = WarpedDraftSource(drafter, LogitsProcessorList(), prefix[None])
        root = int(torch.randint(0, _Config.vocab_size, (1,), generator=gen))
        fast = answer_from(source, draft_greedy_chain(DraftTree.root(root), 0, 6, source.capabilities))
        slow = answer_from(LogprobsOnly(source), draft_greedy_chain(DraftTree.root(root), 0, 6, frozenset()))
        assert torch.equal(fast.tokens, slow.tokens), trial
        assert torch.equal(fast.parents, slow.parents) and torch.equal(fast.depth, slow.depth)
        torch.testing.assert_close(fast.scores, slow.scores)
        lengths[fast.num_nodes - 1] += 1
    assert lengths[6] and sum(lengths.values()) > lengths[6]  # full chains and chains cut where nothing follows


def test_fast_paths_step_aside_for_logits_processors():
    """A processor may reorder the drafter's scores: only the dense route sees the warped distribution."""
    drafter = prompt_lookup(_Model())
    drafter.start(torch.tensor([1, 2, 1, 3, 1, 2]))
    prefix = torch.tensor([[1, 2, 1, 3, 1, 2, 1]])
    warped = WarpedDraftSource(drafter, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)]), prefix)
    tree = DraftTree.root(1)
    assert warped.capabilities == frozenset()
    with pytest.raises(RuntimeError, match="logits processors"):
        warped.greedy_chain(tree, 0, 3)
    plain = WarpedDraftSource(drafter, LogitsProcessorList(), prefix)
    assert plain.capabilities == {"greedy_chain", "topk_logprobs"}
    assert plain.greedy_chain(tree, 0, 3)[0].numel() > 0 and plain.num_forwards == 1


@pytest.mark.parametrize("policy", ["optimal", "salf", "eagle2"])
def test_sparse_children_build_the_dense_tree(policy):
    """Contexts without count ties: the sparse top-k and the dense top-k must grow the same tree."""
    prefix = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 5, 2, 3, 6, 1, 2, 3])
    drafter = prompt_lookup(_Model(), max_ngram_size=2)
    drafter.start(prefix)
    source = WarpedDraftSource(drafter, LogitsProcessorList(), prefix[None])
    builder = POLICIES.get(policy)(tree_budget=6)
    fast = builder.build(source, 1, context=StepContext(1))
    slow = builder.build(LogprobsOnly(source), 1, context=StepContext(1))
    assert fast.num_nodes > 3
    assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.parents, slow.parents)
    torch.testing.assert_close(fast.scores, slow.scores)
    values, tokens = answer_from(source, topk_children(fast, torch.tensor([1]), 3, source.capabilities))
    ref = reference_continuations(prefix.tolist(), path_tokens(fast, 1), 2)
    assert tokens[0, torch.isfinite(values[0])].tolist() == sorted(ref, key=lambda t: (-ref[t], t))[:3]


def test_add_path_equals_add_children_and_chain_mask():
    tree = DraftTree.root(7).add_children(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([-0.1, -2.0]))
    tokens, logprobs = torch.tensor([3, 4, 5]), torch.tensor([-0.5, -0.25, -1.0])
    fast = tree.add_path(1, tokens, logprobs)
    slow, node = tree, 1
    for token, logprob in zip(tokens, logprobs):
        slow = slow.add_children(torch.tensor([node]), token.reshape(1), logprob.reshape(1))
        node = slow.num_nodes - 1
    for name in ("tokens", "parents", "depth", "uids"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    torch.testing.assert_close(fast.scores, slow.scores)
    assert fast.next_uid == slow.next_uid
    assert tree.add_path(0, tokens[:0], logprobs[:0]) is tree
    chain = DraftTree.root(7).add_path(0, tokens, logprobs)  # the triangular shortcut of ancestor_mask
    reference = torch.tensor([[j <= i for j in range(4)] for i in range(4)])
    assert torch.equal(chain.ancestor_mask(), reference)
    branched = fast.select(torch.tensor([0, 1, 2, 3]))  # depths 0, 1, 1, 2: not a chain, pointer chasing
    assert torch.equal(branched.ancestor_mask(), torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool))


def test_greedy_verifier_breaks_ties_like_argmax():
    tree = DraftTree.root(0).add_children(torch.tensor([0, 0]), torch.tensor([2, 5]), torch.zeros(2))
    logits = torch.zeros(3, 8)
    logits[0, [5, 2]] = 1.0  # a tie: argmax takes the first, token 2
    result = GreedyVerifier().verify(tree, logits)
    assert result.accepted.tolist() == [0, 1] and result.next_token == 0


@pytest.mark.parametrize("policy", ["chain", "optimal", "salf", "eagle2"])
@pytest.mark.parametrize("penalty", [None, 1.3])
def test_lookup_greedy_identity(target, policy, penalty):
    torch.manual_seed(11)
    ids = torch.randint(0, 64, (1, 48))
    kwargs = {} if penalty is None else {"repetition_penalty": penalty}
    ref = target.generate(ids, do_sample=False, max_new_tokens=48, **kwargs)
    out = target.generate(ids, do_sample=False, max_new_tokens=48, assistant_model=prompt_lookup(target),
                          tree_policy=policy, tree_budget=None if policy == "chain" else 8,
                          return_dict_in_generate=True, **kwargs)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    if policy == "chain" and penalty is None:  # the whole chain in one drafter call per step
        assert out.draft_forwards == len(out.accepted_lengths)


@pytest.mark.parametrize("policy", ["dyspec", "iid", "swor", "delayed", "static"])
def test_nodes_without_a_proposal_get_no_children(target, policy):
    """A short prompt leaves most nodes without a lookup match (q undefined there): sampled and static shapes must
    leave those nodes childless instead of drawing from NaN or indexing an empty top-k."""
    prompt = torch.tensor([[3, 17, 42, 8, 8, 21]])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    torch.manual_seed(0)  # sampled shapes: which nodes get a proposal is drawn
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=prompt_lookup(target),
                          tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy))
    assert_drafted(out, accepting=False)  # the lookup drafts where the prompt repeats; acceptance is not the point
    assert torch.equal(out.sequences, ref)
