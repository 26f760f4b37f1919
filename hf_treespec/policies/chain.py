"""Single-path drafting: argmax at T=0 (deterministic), a sample from q when sampling (chain speculative sampling).

Optional early exits (the dynamic chain baselines of the C2T paper's chain-mode table): ``chain_min_prob`` stops
before a position whose top draft probability is below it (DyMax), ``chain_min_joint`` before a position where the
chain's joint draft probability times that top probability is below it (DyJoint; at T=0 that is the next node's joint
probability). Both decide from the next distribution before its token is drawn, so the drafted chain stays a
draw from q and chain verification stays lossless.
"""

from __future__ import annotations

import math

import torch

from ..randomness import categorical_rows
from ..tree import DraftTree, Regime
from .base import POLICIES, Draft, Growth, LogprobsRequest, TreePolicy, draft_greedy_chain


@POLICIES.register("chain")
class ChainPolicy(TreePolicy):
    defaults = {"tree_depth": 5, "chain_min_prob": 0.0, "chain_min_joint": 0.0}
    default_verifier = "naive"

    def validate(self) -> None:
        super().validate()
        for key in ("chain_min_prob", "chain_min_joint"):
            value = float(self.params[key])
            if not 0 <= value < 1:
                raise ValueError(f"{key} must be in [0, 1) (a draft probability; 0 = off), got {value}.")

    @property
    def is_chain(self) -> bool:
        return True

    def regime_for(self) -> str:
        return Regime.IID if self.do_sample else Regime.DETERMINISTIC

    def grow(self, root_token, *, context, capabilities=frozenset(), generator=None) -> Growth:
        tree = DraftTree.root(root_token, regime=self.regime_for())
        depth = int(self.params["tree_depth"])
        min_prob, min_joint = float(self.params["chain_min_prob"]), float(self.params["chain_min_joint"])
        early_exit = min_prob > 0 or min_joint > 0
        if not self.do_sample and not early_exit:
            return Draft((yield from draft_greedy_chain(tree, 0, depth, capabilities)))
        node = torch.zeros(1, dtype=torch.long)
        joint = 0.0  # log joint draft probability of the chain so far
        for _ in range(depth):
            logq = (yield LogprobsRequest(tree, node))[0]
            if not bool(torch.isfinite(logq).any()):  # the drafter has no proposal here
                break
            if early_exit:
                top, best = (float(x) for x in logq.max(dim=-1))
                if top < math.log(min_prob or 1e-300) or joint + top < math.log(min_joint or 1e-300):
                    break
            if self.do_sample:
                q = logq.exp()
                tree = tree.record_draft_probs(node, q[None])
                token = categorical_rows(q[None])
            else:
                token = torch.tensor([int(best)])
            tree = tree.add_children(node, token, logq[token])
            if min_joint > 0:  # a host read per level only when the joint probability decides
                joint += float(logq[token])
            node = torch.tensor([tree.num_nodes - 1])
        return Draft(tree)
