"""Traversal verification (Weng et al. 2025): bottom-up over an i.i.d. draft tree (docs/algorithms.md section 5).

Each node carries a weight w and its *current* target distribution P (a residual once a child subtree was rejected).
A node's subtree is processed depth first: child c (token x) gets w_c = min(1, w P(x) / q(x)) and its own fresh p;
when c's subtree is rejected the node updates P <- norm((w P - q)+) and w <- Z / (Z + 1 - w), Z = sum (w P - q)+;
once no child is left the node is accepted with probability w and emits y ~ P. On one chain this is exactly block
verification.

Invariant (by induction over depth and over the children, checked exactly by the tests): a node entered with
(w, P) ends accepted with probability w, then emitting sequences with law P, *whatever the shape of its subtree*,
as long as that shape is decided by tokens above or beside the node. Children here are i.i.d. draws from q, so q
stays as it is after a rejection (docs/algorithms.md's "remove token(v) from q" is the rule for siblings sampled without
replacement). Equal draws are merged into one child with a multiplicity: the verifier visits the k copies in a
uniformly random order (the law of the i.i.d. draw order given the multiset); the first copy of a token carries the
merged subtree. A later copy can never pass (the first copy was either accepted with probability 1 or left
w P(x) < q(x), hence P(x) = 0 after the update) but still counts as one more rejected i.i.d. draw, which updates
P and w. Trees that repeat a token among siblings without counting it are refused: the copies would own subtrees.

[inferred] How multiplicity is handled is our reconstruction. The alternative that visits each distinct token
once and removes it from q is lossless too, but accepts less when the draft repeats a token: on one level of k = 3
drafts of a toy problem, 0.148 against 0.231 for this version, which equals SpecInfer on a single level.
"""

from __future__ import annotations

import torch

from ..randomness import Randomness, bernoulli
from ..tree import DraftTree, Regime
from .base import VERIFIERS, Verifier, VerifyResult, sample, target_probs
from .topdown import pick


@VERIFIERS.register("traversal")
class TraversalVerifier(Verifier):
    lossless_regimes = frozenset({Regime.IID})
    needs_draft_probs = True

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, generator: Randomness = None) -> VerifyResult:
        probs = target_probs(target_logits)
        path, token = self._visit(tree, probs, tree.multiplicity(), 0, probs.new_ones(()), probs[0], generator)
        return VerifyResult(accepted=torch.tensor(path[::-1], device=tree.device), next_token=token)

    def _visit(self, tree, probs, multiplicity, node, weight, current, generator) -> tuple[list[int], int] | None:
        """Processes ``node``'s subtree; returns (accepted path leaf -> node, next token) or None when rejected.
        The root is always accepted (its weight stays 1; not re-tested, so rounding cannot reject it)."""
        kids = tree.children(node)
        if kids.numel():
            tokens = tree.tokens[kids]
            if tokens.unique().numel() != tokens.numel():
                raise ValueError(
                    "verifier='traversal' needs i.i.d. trees whose equal draws are merged into one child with a count, "
                    "as tree_policy='iid' builds them; this tree repeats a token among siblings. Use "
                    "tree_policy='iid' with it, or verifier='specinfer' for this policy."
                )
            q = tree.draft_q(node).to(probs.dtype)
            left = multiplicity[kids].to(probs.dtype).clone()
            visited = [False] * kids.numel()
            for _ in range(int(multiplicity[kids].sum())):
                i = pick(left, generator)
                if not visited[i]:  # the first copy of a token carries the merged subtree; later ones have weight 0
                    visited[i] = True
                    child, x = int(kids[i]), int(tokens[i])
                    child_weight = (weight * current[x] / q[x]).clamp(max=1)
                    found = self._visit(tree, probs, multiplicity, child, child_weight, probs[child], generator)
                    if found is not None:
                        found[0].append(node)
                        return found
                excess = (weight * current - q).clamp(min=0)
                mass = excess.sum()
                if float(mass) > 0:
                    current = excess / mass
                denom = mass + (1 - weight)
                weight = mass / denom if float(denom) > 0 else torch.ones_like(weight)
                left[i] -= 1
        if node == 0 or bool(bernoulli(weight, generator)):
            return [node], sample(current, generator)
        return None
