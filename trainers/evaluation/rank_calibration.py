"""Rank-conditioned accuracy and calibration of a feature drafter (the SALF & TALF paper's Figure 2 and Appendix A).

At a root position ``r`` of a held-out sequence (context ``x_0..x_r``) the drafter drafts ``q = p^(d)_{r+1}``; its
rank-n token ``c_n`` (n = 1..K) is then fed back to the drafter as a tree node, exactly as tree drafting does (through
the :class:`~hf_treespec.drafters.FeatureDrafter` adapter: the node's input feature is the drafter's own output at the
root), giving ``p^(d)_{r+2} | c_n``. The target, conditioned on the same ``x_0..x_r, c_n``, gives its greedy token
``g2_n``; its greedy token at the root is ``g1``. Per root and rank this records:

* depth 1: ``q(c_n)`` and whether ``c_n == g1`` (the rank-n candidate is the target's greedy token, i.e. accepted by
  greedy verification): a reliability diagram per rank, the calibration a probability-ordered tree relies on;
* depth 2 (Figure 2(b)): whether ``argmax p2 == g2_n`` (top-1 accuracy) and the confidences for the ECE, both as the
  paper defines it (bins by ``p2(g2_n)``) and as Guo et al. do (bins by ``max p2``);
* optionally (Figure 2(a)), the rank of every node of the tree a policy (SALF) builds at that root, among its
  siblings: in a probability-ordered tree a node's rank among its siblings is its rank in the parent's distribution.

The target runs once over each sequence plus once over all candidates of all its roots (a 4D tree mask over the
cached sequence); the drafter runs per root through the production adapter, so what is measured is what decoding
drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import LogitsProcessorList

from hf_treespec.api import (
    float_mask, CACHE_KWARG, output_cache, FeatureDrafter, TargetFeatures, capture_hidden_states, WarpedDraftSource,
    StepContext, DraftTree,
)


@dataclass
class RootRecords:
    """Per (root, rank) measurements, ``[roots, K]`` each; ``tree_ranks`` holds one rank per tree node (all roots)."""

    q1: torch.Tensor  # draft probability of the rank-n candidate at depth 1
    hit1: torch.Tensor  # bool: candidate == target's greedy token at the root
    acc2: torch.Tensor  # bool: drafter's argmax after the candidate == target's greedy token after it
    conf2_target: torch.Tensor  # p2(g2_n): the paper's ECE confidence
    conf2_top1: torch.Tensor  # max p2: Guo et al.'s ECE confidence
    tree_ranks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @classmethod
    def concat(cls, parts: Sequence["RootRecords"]) -> "RootRecords":
        if not parts:
            raise ValueError("no roots were measured.")
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in
                     ("q1", "hit1", "acc2", "conf2_target", "conf2_top1", "tree_ranks")))


def sibling_ranks(tree: DraftTree) -> torch.Tensor:
    """Rank (1 = best) of every non-root node among its siblings by draft score; ties share the better rank.

    Siblings share their parent's score, so ordering them by cumulative score orders them by their own draft
    probability: in a tree filled best-first this is the node's rank in its parent's distribution."""
    parents, scores = tree.parents[1:], tree.scores[1:]
    same_parent = parents[:, None] == parents[None, :]
    better = scores[None, :] > scores[:, None]
    return (same_parent & better).sum(-1) + 1


@torch.no_grad()
def measure_sequence(target, drafter, ids: torch.Tensor, roots: Sequence[int], ranks: int = 5,
                     policy=None) -> RootRecords:
    """Measures ``roots`` (indices into ``ids`` ``[L]``, each >= 1) of one sequence; see the module docstring.

    ``drafter`` is a :class:`~hf_treespec.drafters.TreeSpecDrafterModel` tied to ``target``; ``policy`` (a tree
    policy instance, e.g. SALF) adds the sibling ranks of the tree it builds at each root."""
    ids = ids.long().reshape(-1)
    roots = torch.as_tensor(list(roots), dtype=torch.long)
    length = int(ids.numel())
    if roots.numel() == 0:
        raise ValueError("measure_sequence needs at least one root.")
    if int(roots.min()) < 1 or int(roots.max()) >= length:
        raise ValueError(f"roots must lie in [1, {length - 1}] (the drafter's stream starts at the second token).")
    device = next(target.parameters()).device
    ids = ids.to(device)
    layers = list(drafter.config.target_layers)
    with capture_hidden_states(target, layers) as captured:
        out = target(input_ids=ids[None], use_cache=True)
    features = captured.hidden_states[0]  # [L, feature_size]: row i predicts token i + 1
    g1 = out.logits[0].argmax(-1)  # [L]: target's greedy token after each position

    adapter = FeatureDrafter(drafter)
    q1s, cands, p2s, tree_ranks = [], [], [], []
    for r in roots.tolist():
        adapter.start(ids[:r], TargetFeatures(features[:r]))
        tree = DraftTree.root(ids[r])
        q = torch.softmax(adapter.expand(tree, torch.tensor([0]))[0], -1)
        q_top, c_top = q.topk(ranks)
        tree = tree.add_children(torch.zeros(ranks, dtype=torch.long), c_top, q_top.log())
        p2 = torch.softmax(adapter.expand(tree, torch.arange(1, tree.num_nodes)), -1)
        if p2.shape[0] != ranks:
            raise ValueError(f"the drafter gives fewer than {ranks} tokens of nonzero probability at root {r}.")
        q1s.append(q_top)
        cands.append(c_top)
        p2s.append(p2)
        if policy is not None:
            adapter.start(ids[:r], TargetFeatures(features[:r]))
            source = WarpedDraftSource(adapter, LogitsProcessorList(), ids[: r + 1][None])
            built = policy.build(source, int(ids[r]), context=StepContext(int(ids[r]), device=device,
                                                                          context_length=r + 1))
            tree_ranks.append(sibling_ranks(built))
    q1 = torch.stack(q1s)  # [R, K]
    cand = torch.stack(cands).to(device)  # [R, K]
    p2 = torch.stack(p2s)  # [R, K, V]
    g2 = target_after_candidates(target, output_cache(out), roots.to(device), cand, length).argmax(-1)  # [R, K]
    conf2_target = p2.gather(-1, g2[..., None].to(p2.device))[..., 0]
    return RootRecords(
        q1=q1.float().cpu(),
        hit1=(cand == g1[roots.to(device)][:, None]).cpu(),
        acc2=(p2.argmax(-1).to(device) == g2).cpu(),
        conf2_target=conf2_target.float().cpu(),
        conf2_top1=p2.max(-1).values.float().cpu(),
        tree_ranks=torch.cat(tree_ranks).cpu() if tree_ranks else torch.zeros(0, dtype=torch.long),
    )


def target_after_candidates(target, cache, roots: torch.Tensor, cand: torch.Tensor, length: int) -> torch.Tensor:
    """The target's logits after ``x_0..x_r, c`` for every (root r, candidate c), ``[R, K, V]``: one forward of all
    candidates over the cache of the whole sequence (``length`` tokens), each seeing its root's prefix and itself."""
    num_roots, ranks = cand.shape
    count = num_roots * ranks
    device = cand.device
    owner = roots.repeat_interleave(ranks)  # [R*K] root of each candidate
    visible = torch.zeros(count, length + count, dtype=torch.bool, device=device)
    visible[:, :length] = torch.arange(length, device=device)[None, :] <= owner[:, None]
    visible[:, length:] = torch.eye(count, dtype=torch.bool, device=device)
    dtype = next(target.parameters()).dtype
    out = target(input_ids=cand.reshape(1, count), position_ids=(owner + 1)[None],
                 attention_mask=float_mask(visible, dtype), use_cache=True, **{CACHE_KWARG: cache})
    return out.logits[0].reshape(num_roots, ranks, -1)


# ---------------------------------------------------------------------------------------------------- metrics
def reliability(confidence: torch.Tensor, correct: torch.Tensor, bins: int = 10) -> list[dict[str, Any]]:
    """Equal-width confidence bins over [0, 1] (Guo et al.): per non-empty bin its bounds, count, mean confidence
    and accuracy."""
    if confidence.shape != correct.shape:
        raise ValueError(f"confidence {tuple(confidence.shape)} and correct {tuple(correct.shape)} differ in shape.")
    confidence, correct = confidence.reshape(-1).double(), correct.reshape(-1).double()
    index = (confidence * bins).long().clamp(0, bins - 1)
    rows = []
    for b in range(bins):
        inside = index == b
        n = int(inside.sum())
        if n:
            rows.append({"lo": b / bins, "hi": (b + 1) / bins, "count": n,
                         "confidence": float(confidence[inside].mean()), "accuracy": float(correct[inside].mean())})
    return rows


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, bins: int = 10) -> float:
    """ECE = sum_m |B_m| / N * |acc(B_m) - conf(B_m)| over equal-width bins (the paper's Appendix A formula)."""
    rows = reliability(confidence, correct, bins)
    total = sum(row["count"] for row in rows)
    return sum(row["count"] / total * abs(row["accuracy"] - row["confidence"]) for row in rows)


def summarize(records: RootRecords, bins: int = 10, max_tree_rank: int = 5) -> dict[str, Any]:
    """Per-rank depth-1 reliability and depth-2 accuracy / ECE, plus the tree's rank proportions (ranks above
    ``max_tree_rank`` pooled as ``">=max_tree_rank"``, as the paper's Figure 2(a) pools the 5th and lower)."""
    ranks = records.q1.shape[1]
    per_rank = []
    for n in range(ranks):
        q, hit = records.q1[:, n], records.hit1[:, n]
        acc, conf_t, conf_1 = records.acc2[:, n], records.conf2_target[:, n], records.conf2_top1[:, n]
        per_rank.append({
            "rank": n + 1,
            "roots": int(q.numel()),
            "depth1_mean_q": round(float(q.mean()), 4),
            "depth1_target_greedy_rate": round(float(hit.double().mean()), 4),
            "depth1_ece": round(expected_calibration_error(q, hit, bins), 4),
            "depth1_reliability": reliability(q, hit, bins),
            "depth2_top1_accuracy": round(float(acc.double().mean()), 4),
            "depth2_ece_paper": round(expected_calibration_error(conf_t, acc, bins), 4),
            "depth2_ece_top1": round(expected_calibration_error(conf_1, acc, bins), 4),
            "depth2_mean_confidence_top1": round(float(conf_1.mean()), 4),
        })
    summary: dict[str, Any] = {"ranks": per_rank, "bins": bins}
    if records.tree_ranks.numel():
        tr = records.tree_ranks
        shares = {str(n): round(float((tr == n).double().mean()), 4) for n in range(1, max_tree_rank)}
        shares[f">={max_tree_rank}"] = round(float((tr >= max_tree_rank).double().mean()), 4)
        summary["tree_rank_share"] = shares
        summary["tree_nodes"] = int(tr.numel())
    return summary
