"""Batched drafting across the rows of a batch: `Drafter.expand_rows` (one forward over rows with their own caches)
must give every row the logits its own forward gives, and `draft_trees` must join the rows' draft forwards into
rounds without threads, give every row the tree its policy builds alone, keep seeded runs reproducible and hand a
row's error to the caller."""

import threading

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from hf_treespec.drafters import TargetFeatures, TreeSpecDrafterConfig, TreeSpecDrafterModel, as_drafter
from hf_treespec.generation.draft_source import WarpedDraftSource
from hf_treespec.generation.drafting import draft_trees
from hf_treespec.policies import POLICIES
from hf_treespec.policies.base import Draft, LogprobsRequest, TreePolicy
from hf_treespec.step_context import StepContext
from hf_treespec.tree import DraftTree

from conftest import assert_drafted
from test_batched_generate import PAD, left_padded

PREFIXES = [[3, 17, 42, 8, 8, 21, 5], [5, 9, 33], [11, 40, 7, 7, 19]]


def feature_model(target) -> TreeSpecDrafterModel:
    torch.manual_seed(0)
    model = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(target.config)).eval()
    model.tie_to_target(target)
    return model


def started(model, target, prefixes):
    """One drafter per row, started on its prefix (random target features for a feature drafter)."""
    rows = []
    for i, prefix in enumerate(prefixes):
        drafter = as_drafter(model, target=target)
        size = getattr(model.config, "feature_size", None)
        features = TargetFeatures(torch.randn(len(prefix), size, generator=torch.Generator().manual_seed(i))) \
            if size else None
        drafter.start(torch.tensor(prefix), features)
        rows.append(drafter)
    return rows


def children(tree: DraftTree, nodes: torch.Tensor, logits: torch.Tensor, k: int) -> DraftTree:
    values, tokens = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return tree.add_children(nodes[:, None].expand(-1, k).reshape(-1), tokens.reshape(-1), values.reshape(-1))


@pytest.mark.parametrize("kind", ["causal_lm", "feature", "feature, preallocated"])
def test_expand_rows_equals_one_forward_per_row(target, drafters, kind, monkeypatch):
    """Rows of different lengths, different numbers of nodes per round, two steps with commits in between (the
    feature drafter then re-feeds its accepted chain as pending tokens): every row's logits equal its own forward's.
    Preallocated row caches (a compiled drafter's) are stacked from their buffers, rows past a row's length
    included and masked: the same logits."""
    from hf_treespec.compiled.preallocated import preallocate
    from hf_treespec.kv import stacked

    model = feature_model(target) if kind.startswith("feature") else drafters["random"]
    alone, batched = started(model, target, PREFIXES), started(model, target, PREFIXES)
    from_buffers = []
    if kind.endswith("preallocated"):
        for drafter in batched:
            preallocate(drafter.kv.cache, 64)
        join = stacked._stacked_from_buffers
        monkeypatch.setattr(stacked, "_stacked_from_buffers", lambda *args: from_buffers.append(join(*args)) or
                            from_buffers[-1])
    trees = [DraftTree.root(prefix[-1]) for prefix in PREFIXES]
    for step in range(2):
        frontier = [torch.zeros(1, dtype=torch.long)] * len(trees)
        for round_ in range(3):
            expected = [d.expand(tree, nodes) for d, tree, nodes in zip(alone, trees, frontier)]
            got = type(batched[0]).expand_rows(list(zip(batched, trees, frontier)))
            for row, (want, have) in enumerate(zip(expected, got)):
                torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5, msg=f"step {step} round {round_} row {row}")
            new_trees = []
            for row, (tree, nodes, logits) in enumerate(zip(trees, frontier, expected)):
                grown = children(tree, nodes, logits, k=1 + (row + round_) % 3)
                frontier[row] = torch.arange(tree.num_nodes, grown.num_nodes)
                new_trees.append(grown)
            trees = new_trees
        for row, tree in enumerate(trees):  # accept the root and the first path of row-dependent length
            path = [0]
            while len(path) <= row and bool((tree.parents == path[-1]).any()):
                path.append(int((tree.parents == path[-1]).nonzero()[0]))
            accepted = torch.tensor(path)
            size = getattr(model.config, "feature_size", None)
            features = TargetFeatures(torch.randn(len(path), size)) if size else None
            alone[row].commit(tree, accepted, features)
            batched[row].commit(tree, accepted, features)
            trees[row] = DraftTree.root(int(tree.tokens[path[-1]]))
    # (the first round feeds every row from an empty cache: nothing to stack)
    assert all(from_buffers) and len(from_buffers) == (5 if kind.endswith("preallocated") else 0)


def test_draft_forwards_are_joined_into_rounds(target, drafters):
    """A batch of 3 drafting depth-4 chains runs at most 4 drafter forwards per step, not one per row."""
    calls = []
    handle = drafters["perturbed"].register_forward_hook(lambda *args: calls.append(1))
    try:
        ids, mask = left_padded()
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD,
                              assistant_model=drafters["perturbed"], tree_policy="chain", tree_depth=4,
                              return_dict_in_generate=True)
    finally:
        handle.remove()
    assert_drafted(out)
    steps = max(len(lengths) for lengths in out.row_accepted_lengths)
    per_row = sum(len(lengths) for lengths in out.row_accepted_lengths)
    assert len(calls) == out.draft_forwards <= 4 * steps < 4 * per_row


def test_seeded_sampled_batch_reproduces(target, drafters):
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, do_sample=True, max_new_tokens=16, pad_token_id=PAD, temperature=1.0,
                  assistant_model=drafters["perturbed"], tree_policy="dyspec", verifier="swor", tree_budget=8,
                  return_dict_in_generate=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(target.generate(ids, **kwargs))
    assert_drafted(runs[0], accepting=False)
    assert torch.equal(runs[0].sequences, runs[1].sequences)


class ScriptedPolicy(TreePolicy):
    """Row i asks for ``depths[i]`` one-node forwards at the root, then returns; a depth of -1 raises after one."""

    name = "scripted"

    def __init__(self, depths):
        super().__init__()
        self.depths = depths

    def grow(self, root_token, *, context, capabilities=frozenset(), generator=None):
        tree = DraftTree.root(root_token)
        depth = self.depths[root_token]
        for _ in range(max(depth, 1)):
            yield LogprobsRequest(tree, torch.zeros(1, dtype=torch.long))
            if depth < 0:
                raise ValueError("policy failed on purpose")
        return Draft(tree, (1, depth) if depth else None)


def row_sources(target, drafters, processors=None):
    rows = started(drafters["random"], target, PREFIXES)
    return [WarpedDraftSource(row, processors or LogitsProcessorList(), torch.tensor([p]))
            for row, p in zip(rows, PREFIXES)]


def test_rounds_shapes_and_a_rows_error(target, drafters):
    contexts = [StepContext(i) for i in range(3)]
    drafts = draft_trees(ScriptedPolicy([3, 0, 2]), row_sources(target, drafters), contexts)
    assert drafts.rounds == 3 and [int(t.tokens[0]) for t in drafts.trees] == [0, 1, 2]
    assert drafts.shapes == [(1, 3), None, (1, 2)]
    with pytest.raises(ValueError, match="on purpose"):
        draft_trees(ScriptedPolicy([3, -1, 2]), row_sources(target, drafters), contexts)


@pytest.mark.parametrize("name,params", [("salf", {"tree_budget": 12}), ("eagle2", {"tree_budget": 10}),
                                         ("chain", {}), ("dyspec", {"tree_budget": 8}), ("iid", {}),
                                         ("swor", {}), ("static", {"tree_budget": 8}), ("delayed", {})])
def test_each_row_gets_the_tree_its_policy_builds_alone(target, drafters, name, params):
    """Rows drafting together (one forward per round) grow exactly the trees each grows alone with ``build``, the
    logits processors applied per row. Sampled policies draw in round order, so there a batch of one equals
    ``build`` under the same seed and a batch of three reproduces under the same seed."""
    do_sample = name in ("iid", "swor", "delayed", "dyspec")
    policy = POLICIES.get(name)(do_sample=do_sample, **params)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8)]) if do_sample else None
    contexts = [StepContext(p[-1]) for p in PREFIXES]

    def same(mine, own):
        assert torch.equal(mine.tokens, own.tokens) and torch.equal(mine.parents, own.parents)
        torch.testing.assert_close(mine.scores, own.scores, atol=1e-5, rtol=1e-5)

    def together(rows):
        torch.manual_seed(3)
        return draft_trees(policy, row_sources(target, drafters, processors)[:rows], contexts[:rows]).trees

    def alone(rows):
        torch.manual_seed(3)
        return [policy.build(source, c.root_token, context=c)
                for source, c in zip(row_sources(target, drafters, processors)[:rows], contexts)]

    if do_sample:
        same(together(1)[0], alone(1)[0])
        for mine, own in zip(together(3), together(3)):
            same(mine, own)
        assert sum(t.num_nodes for t in together(3)) > 3
    else:
        for mine, own in zip(together(3), alone(3)):
            same(mine, own)


def test_the_documented_policy_drafts_one_sequence_and_a_batch(target, drafters):
    """docs/policies.md's example policy: exact in a batch of two, two draft forwards a step."""

    @POLICIES.register("two_paths")
    class TwoPaths(TreePolicy):
        def grow(self, root_token, *, context, capabilities=frozenset(), generator=None):
            tree = DraftTree.root(root_token)
            root = torch.zeros(1, dtype=torch.long)
            logq = yield LogprobsRequest(tree, root)
            values, tokens = logq.topk(2, dim=-1)
            tree = tree.add_children(root.expand(2), tokens[0], values[0])
            children = torch.tensor([1, 2])
            best = (yield LogprobsRequest(tree, children)).max(dim=-1)
            return Draft(tree.add_children(children, best.indices, best.values))

    try:
        ids, mask = left_padded()
        plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                              assistant_model=drafters["perturbed"], tree_policy="two_paths",
                              return_dict_in_generate=True)
    finally:
        POLICIES.unregister("two_paths")
    assert_drafted(out)
    steps = max(len(lengths) for lengths in out.row_accepted_lengths)
    assert torch.equal(out.sequences, plain) and set(out.tree_sizes) == {4} and out.draft_forwards == 2 * steps


def test_no_thread_is_started_during_a_batched_generate(target, drafters, monkeypatch):
    started_threads = []
    original = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started_threads.append(self) or original(self))
    before = threading.active_count()
    ids, mask = left_padded()
    target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=PAD,
                    assistant_model=drafters["perturbed"], tree_policy="salf", tree_budget=8)
    assert not started_threads and threading.active_count() == before


@pytest.mark.parametrize("name", ["greedy", "nss"])
def test_verify_rows_equals_one_verify_per_row(name):
    """A batch's drafted rows verified in one call give each row what its own `verify` gives (sampling verifiers:
    the same draws in row order)."""
    from hf_treespec.verifiers import VERIFIERS

    gen = torch.Generator().manual_seed(0)
    trees, logits = [], []
    for size in (3, 1, 5):
        tree = DraftTree.root(1)
        for _ in range(size):
            parent = torch.randint(0, tree.num_nodes, (1,), generator=gen)
            tree = tree.add_children(parent, torch.randint(0, 8, (1,), generator=gen), torch.tensor([-0.5]))
        trees.append(tree)
        logits.append(torch.randn(tree.num_nodes, 8, generator=gen) * 3)
    verifier = VERIFIERS.get(name)()
    torch.manual_seed(5)
    together = verifier.verify_rows(trees, logits)
    torch.manual_seed(5)
    alone = [verifier.verify(tree, rows) for tree, rows in zip(trees, logits)]
    assert [(r.accepted.tolist(), r.next_token) for r in together] == \
        [(r.accepted.tolist(), r.next_token) for r in alone]
