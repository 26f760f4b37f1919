"""Block verification (Sun et al. 2024): the optimal verifier for one sampled chain (docs/algorithms.md section 4)."""

from __future__ import annotations

import torch

from ..randomness import Randomness, bernoulli
from ..tree import DraftTree, Regime
from .base import VERIFIERS, Verifier, VerifyResult, sample, target_probs


@VERIFIERS.register("block")
class BlockVerifier(Verifier):
    """Accepts the longest prefix X_1..X_tau whose independent test passes, instead of stopping at the first failure.

    w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_{i-1}(X_i)); h_i = Z_i / (Z_i + 1 - w_i) with
    Z_i = sum_x (w_i p_i(x) - q_i(x))+ for i < g, h_g = w_g; tau = max{i : eta_i <= h_i}; the next token is drawn
    from p_g when tau = g, else from norm((w_tau p_tau - q_tau)+). All but the draws is vectorised over the chain.
    """

    lossless_regimes = frozenset({Regime.IID, Regime.SWOR})
    chain_only = True
    needs_draft_probs = True

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, generator: Randomness = None) -> VerifyResult:
        if not tree.is_chain():
            raise ValueError("verifier='block' verifies a single chain; this tree branches.")
        probs = target_probs(target_logits)
        chain = tree.depth.argsort()  # node at each depth 0..g
        g = chain.numel() - 1
        if g == 0:
            return VerifyResult(accepted=chain, next_token=sample(probs[0], generator))
        p = probs[chain]  # [g + 1, V]
        q = torch.stack([tree.draft_q(int(v)) for v in chain[:-1]]).to(p.dtype)  # [g, V]
        drafts = tree.tokens[chain[1:]]
        steps = torch.arange(g, device=p.device)
        ratio = p[steps, drafts] / q[steps, drafts]
        # w_i = min(1, w_{i-1} r_i)  <=>  log w_i = S_i - max(0, S_1..S_i) with S the cumulative sum of log r
        cum = ratio.log().cumsum(0)
        weights = torch.cat([p.new_ones(1), (cum - cum.cummax(0).values.clamp(min=0)).exp()])  # w_0..w_g
        excess = (weights[:-1, None] * p[:-1] - q).clamp(min=0)  # [g, V], row i: (w_i p_i - q_i)+
        mass = excess.sum(-1)
        denom = mass[1:] + (1 - weights[1:-1])
        inner = torch.where(denom > 0, mass[1:] / denom.clamp(min=torch.finfo(p.dtype).tiny), 1.0)  # h_1..h_{g-1}
        h = torch.cat([inner, weights[-1:]])
        passed = bernoulli(h, generator)  # eta_i <= h_i for i = 1..g
        hits = passed.nonzero().flatten()
        tau = int(hits[-1]) + 1 if hits.numel() else 0
        if tau == g:
            token = sample(p[g], generator)
        else:
            rest = excess[tau]
            token = sample(rest if float(rest.sum()) > 0 else p[tau], generator)
        return VerifyResult(accepted=chain[: tau + 1], next_token=token)
