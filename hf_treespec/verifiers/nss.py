"""NSS (what EAGLE-2/3 do at T>0): at each node sample Y ~ p; descend if Y is a child, else emit Y.

Lossless for any tree because the draft distribution q is never used (docs/algorithms.md section 2).
"""

from __future__ import annotations

import torch

from ..tree import Regime
from .base import VERIFIERS, Verifier, VerifyResult, sample, target_probs
from .branching import BranchingLaw


@VERIFIERS.register("nss")
class NSSVerifier(Verifier, BranchingLaw):
    lossless_regimes = frozenset(Regime.ALL)

    def branching(self, table, order):
        """y ~ p, so a child is entered with its target probability."""
        return {c: table.residuals[0][c] for c in order}

    def verify(self, tree, target_logits, generator=None) -> VerifyResult:
        probs = target_probs(target_logits)
        node, path = 0, [0]
        while True:
            y = sample(probs[node], generator)
            hit = ((tree.parents == node) & (tree.tokens == y)).nonzero()
            if hit.numel() == 0:
                return VerifyResult(accepted=torch.tensor(path, device=tree.device), next_token=y)
            node = int(hit[0])
            path.append(node)
