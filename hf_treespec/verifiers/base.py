"""Verifier interface: a verifier sees a `DraftTree` and target logits, never a model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
import torch

from ..randomness import Randomness, categorical, categorical_rows
from ..registry import Registry
from ..tree import DraftTree, Regime

VERIFIERS: Registry["Verifier"] = Registry("verifier")


@dataclass
class VerifyResult:
    """Outcome of one verification step.

    Attributes:
        accepted: node indices of the accepted path, root first (the root is always "accepted": it is committed).
        next_token: the token emitted after the accepted path (bonus or correction token).
    """

    accepted: torch.Tensor
    next_token: int

    @property
    def num_accepted_drafts(self) -> int:
        return int(self.accepted.numel()) - 1


class Verifier(ABC):
    """Decides which path of a draft tree the target accepts, preserving the target distribution.

    Subclasses declare the drafting regimes (:class:`~hf_treespec.tree.Regime`) they are lossless for, whether they
    only verify single chains, and whether they work at T=0 (greedy) or need sampling.
    """

    name: str = ""
    lossless_regimes: frozenset[str] = frozenset(Regime.ALL)
    chain_only: bool = False
    sampling: bool = True  # False for the T=0 (argmax) verifier
    needs_draft_probs: bool = False
    #: whether `verify` reads ``target_logits[node]`` (an int) for the nodes its walk visits and nothing else: the
    #: loop then hands it a `~hf_treespec.generation.processors.NodeRows` that processes a row on its first read
    reads_visited_rows: bool = False

    @abstractmethod
    def verify(self, tree: DraftTree, target_logits: torch.Tensor, generator: Randomness = None) -> VerifyResult:
        """``target_logits``: ``[n, V]`` processed (warped) target logits at every tree node, float32.

        ``generator``: a ``torch.Generator`` or a `~hf_treespec.randomness.RandomSource` (every random choice goes
        through `hf_treespec.randomness`, so the exact-enumeration tests can integrate it out)."""

    def verify_rows(self, trees: list[DraftTree], target_logits: list[torch.Tensor],
                    generator: Randomness = None) -> list[VerifyResult]:
        """`verify` for every drafted row of a batch (``target_logits[i]``: ``[n_i, V]`` for ``trees[i]``). Default:
        one `verify` per row, in row order; a verifier whose rule allows it overrides this with one call over the
        rows (one host copy for the batch instead of one per row)."""
        return [self.verify(tree, logits, generator) for tree, logits in zip(trees, target_logits)]

    def target_choice(self, target_logits: torch.Tensor, generator: Randomness = None) -> int:
        """The token after a root-only tree (a draft-free step) from its processed row ``[V]``: what plain
        ``generate`` picks, the argmax at T=0, else one draw from the target distribution. Every verifier accepts
        exactly this on a root-only tree; the loop calls it without building the tree's verification inputs."""
        if not self.sampling:  # max().indices is argmax (first maximum on ties), faster over a vocabulary on CPU
            return int(target_logits.max(-1).indices)
        return sample(target_probs(target_logits), generator)

    def target_choices(self, target_logits: torch.Tensor) -> torch.Tensor:
        """`target_choice` for ``[n, V]`` processed rows of root-only trees at once (a batch's draft-free rows): the
        argmax at T=0, else one draw per row from its target distribution, as plain ``generate`` samples a batch
        (one vectorised draw, not a softmax and a host read per row)."""
        if not self.sampling:
            return target_logits.max(-1).indices
        return categorical_rows(target_probs(target_logits))

    # --------------------------------------------------------------------------------------------- compatibility
    @classmethod
    def check_compatible(cls, regime: str, *, is_chain: bool, do_sample: bool, policy: str = "") -> None:
        """Raises ValueError when this verifier would not be lossless for the given drafting setup."""
        where = f" with tree_policy={policy!r}" if policy else ""
        if not do_sample and cls.sampling:
            raise ValueError(
                f"verifier={cls.name!r} samples from the target; with do_sample=False use verifier='greedy' "
                "(or pass do_sample=True)."
            )
        if do_sample and not cls.sampling:
            raise ValueError(
                f"verifier={cls.name!r} is the argmax rule and is not lossless when sampling (do_sample=True); "
                "use verifier='nss' or another sampling verifier."
            )
        if cls.sampling and regime not in cls.lossless_regimes:
            valid = [n for n in VERIFIERS if regime in VERIFIERS.get(n).lossless_regimes and VERIFIERS.get(n).sampling]
            raise ValueError(
                f"verifier={cls.name!r} is not lossless for the {regime!r} drafting regime{where} "
                f"(it is lossless for: {', '.join(sorted(cls.lossless_regimes))}). "
                f"Verifiers lossless here: {', '.join(valid)}."
            )
        if cls.chain_only and not is_chain:
            raise ValueError(f"verifier={cls.name!r} verifies a single chain only; use tree_policy='chain' or k=1.")


def target_probs(target_logits: torch.Tensor) -> torch.Tensor:
    """Softmax in float32 (float64 kept, for exact tests) of processed logits (-inf entries become exact zeros)."""
    logits = target_logits if target_logits.dtype == torch.float64 else target_logits.float()
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: Randomness = None) -> int:
    """One draw from a 1-D probability vector (``generator``: a torch.Generator or a `RandomSource`)."""
    return categorical(probs, generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm((p - q)+); falls back to p when the residual is empty (p == q), where it is never sampled anyway. Chosen on
    the device (no host read of the total: one sync less per rejection on a GPU)."""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return torch.where(total > 0, r / total, p)
