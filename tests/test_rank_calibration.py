"""trainers/evaluation/rank_calibration.py: rank-conditioned drafts and target tokens against brute force, metrics by hand."""

from __future__ import annotations

import pytest
import torch

from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel
from hf_treespec.features import capture_hidden_states
from hf_treespec.policies import POLICIES
from hf_treespec.trainers.evaluation.rank_calibration import (
    RootRecords,
    expected_calibration_error,
    measure_sequence,
    reliability,
    sibling_ranks,
    target_after_candidates,
    summarize,
)
from hf_treespec.tree import DraftTree

from conftest import VOCAB


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(0)
    config = TreeSpecDrafterConfig.for_target(target.config, target_layers=[0, 2, -1], input_mode="eagle3",
                                              draft_vocab_size=48)
    model = TreeSpecDrafterModel(config).eval()
    model.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:48].sort().values)
    return model.tie_to_target(target)


@torch.no_grad()
def brute_force(target, drafter, ids: torch.Tensor, r: int, ranks: int):
    """Depth-1 q, its top candidates, depth-2 drafter distributions and target tokens, each from a plain forward."""
    with capture_hidden_states(target, drafter.config.target_layers) as cap:
        logits = target(input_ids=ids[None]).logits[0]
    feats = cap.hidden_states[0]
    stream = drafter(input_ids=ids[1 : r + 1][None], target_hidden_states=feats[:r][None])
    q = torch.softmax(drafter.target_logits(stream.logits[0, -1].float()), -1)
    q_top, cand = q.topk(ranks)
    p2, g2 = [], []
    for c in cand.tolist():  # the candidate, fed with the drafter's own output feature at the root
        projected = drafter.project_features(feats[:r])
        both = torch.cat([projected, stream.hidden_states[0, -1:]])
        out = drafter(input_ids=torch.cat([ids[1 : r + 1], torch.tensor([c])])[None], features=both[None])
        p2.append(torch.softmax(drafter.target_logits(out.logits[0, -1].float()), -1))
        g2.append(int(target(input_ids=torch.cat([ids[: r + 1], torch.tensor([c])])[None]).logits[0, -1].argmax()))
    return q_top, cand, int(logits[r].argmax()), torch.stack(p2), torch.tensor(g2)


def test_measure_sequence_equals_brute_force(target, drafter):
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    roots, ranks = [1, 5, 11, 23], 4
    rec = measure_sequence(target, drafter, ids, roots, ranks=ranks)
    assert rec.q1.shape == (4, ranks)
    for i, r in enumerate(roots):
        q_top, cand, g1, p2, g2 = brute_force(target, drafter, ids, r, ranks)
        torch.testing.assert_close(rec.q1[i], q_top, atol=1e-5, rtol=1e-4)
        assert torch.equal(rec.hit1[i], cand == g1)
        assert torch.equal(rec.acc2[i], p2.argmax(-1) == g2)
        torch.testing.assert_close(rec.conf2_target[i], p2.gather(-1, g2[:, None])[:, 0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(rec.conf2_top1[i], p2.max(-1).values, atol=1e-5, rtol=1e-4)


def test_measure_sequence_records_policy_tree_ranks(target, drafter):
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(2))
    policy = POLICIES.get("salf")(tree_budget=12, salf_threshold=0.0)
    rec = measure_sequence(target, drafter, ids, [3, 9], ranks=3, policy=policy)
    assert rec.tree_ranks.numel() == 2 * 12  # a full 12-node tree at each root, one rank per node
    assert int(rec.tree_ranks.min()) == 1
    summary = summarize(rec, bins=5, max_tree_rank=3)
    assert summary["tree_nodes"] == 24 and abs(sum(summary["tree_rank_share"].values()) - 1) < 1e-3


@torch.no_grad()
def test_target_after_candidates_equals_each_path_alone(target):
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    roots, cand = torch.tensor([0, 4, 11]), torch.tensor([[7, 8], [9, 10], [11, 12]])
    cache = target(input_ids=ids[None], use_cache=True).past_key_values
    got = target_after_candidates(target, cache, roots, cand, 12)
    for i, r in enumerate(roots.tolist()):
        for j, c in enumerate(cand[i].tolist()):
            want = target(input_ids=torch.cat([ids[: r + 1], torch.tensor([c])])[None]).logits[0, -1]
            torch.testing.assert_close(got[i, j], want, atol=1e-4, rtol=1e-4)


def test_measure_sequence_rejects_root_zero(target, drafter):
    with pytest.raises(ValueError, match="roots must lie"):
        measure_sequence(target, drafter, torch.arange(8), [0])


def test_sibling_ranks():
    tree = DraftTree.root(0)
    tree = tree.add_children(torch.tensor([0, 0, 0]), torch.tensor([5, 6, 7]), torch.tensor([-0.5, -2.0, -1.0]))
    tree = tree.add_children(torch.tensor([1, 3]), torch.tensor([8, 9]), torch.tensor([-0.1, -0.2]))
    assert sibling_ranks(tree).tolist() == [1, 3, 2, 1, 1]


def test_reliability_and_ece_by_hand():
    conf = torch.tensor([0.05, 0.15, 0.95, 0.91, 0.55])
    correct = torch.tensor([False, True, True, False, True])
    rows = reliability(conf, correct, bins=10)
    assert [r["count"] for r in rows] == [1, 1, 1, 2]
    assert rows[-1]["confidence"] == pytest.approx(0.93) and rows[-1]["accuracy"] == 0.5
    want = (1 * 0.05 + 1 * 0.85 + 1 * 0.45 + 2 * 0.43) / 5
    assert expected_calibration_error(conf, correct, bins=10) == pytest.approx(want)


def test_summarize_per_rank():
    rec = RootRecords(q1=torch.tensor([[0.8, 0.1], [0.6, 0.3]]), hit1=torch.tensor([[True, False], [False, True]]),
                      acc2=torch.tensor([[True, True], [True, False]]),
                      conf2_target=torch.tensor([[0.9, 0.7], [0.5, 0.1]]),
                      conf2_top1=torch.tensor([[0.9, 0.7], [0.5, 0.6]]))
    ranks = summarize(rec)["ranks"]
    assert ranks[0]["depth1_target_greedy_rate"] == 0.5 and ranks[1]["depth2_top1_accuracy"] == 0.5
    assert ranks[0]["depth1_mean_q"] == 0.7
