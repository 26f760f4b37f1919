"""Chain speculative sampling (Leviathan 2023 / Chen 2023) for a single path sampled from q (docs/algorithms.md section 1)."""

from __future__ import annotations

import torch

from ..randomness import bernoulli
from ..tree import Regime
from .base import VERIFIERS, Verifier, VerifyResult, residual, sample, target_probs


@VERIFIERS.register("naive")
class NaiveChainVerifier(Verifier):
    """Token-wise rejection sampling: accept x_i with min(1, p_i(x_i) / q_i(x_i)); on rejection sample norm((p-q)+)."""

    lossless_regimes = frozenset({Regime.IID, Regime.SWOR})
    chain_only = True
    needs_draft_probs = True

    def verify(self, tree, target_logits, generator=None) -> VerifyResult:
        probs = target_probs(target_logits)
        node, path = 0, [0]
        while True:
            kids = tree.children(node)
            if kids.numel() == 0:
                return VerifyResult(accepted=torch.tensor(path, device=tree.device), next_token=sample(probs[node], generator))
            child = int(kids[0])
            q = tree.draft_q(node)
            x = int(tree.tokens[child])
            if bool(bernoulli((probs[node, x] / q[x]).clamp(max=1), generator)):
                node = child
                path.append(node)
                continue
            y = sample(residual(probs[node], q), generator)
            return VerifyResult(accepted=torch.tensor(path, device=tree.device), next_token=y)
