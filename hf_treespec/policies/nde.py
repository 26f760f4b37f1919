"""NDE: delayed expansion whose shape (k, l1, l2) a small learned selector picks per step (delayed-expansion paper,
Section 6 and Appendix E).

Each step the policy first drafts q(. | root) (the first draft call every delayed tree makes anyway), computes the
root features from it and from the :class:`~.context.StepContext` the decoding loop passes, and asks a
:class:`DelaySelector` for the action with the highest probability of being the throughput-optimal one. It then grows
the delayed tree of that shape exactly as ``tree_policy="delayed"`` does (trunk of l1 sampled tokens, k i.i.d. paths
of l2 tokens from its tip), reusing q(. | root). The tree law given the chosen action is the delayed tree's, and the
action depends only on the context and on q(. | root), never on the tokens drawn, so every verifier that is lossless
for i.i.d. trees stays lossless.

Features (both at inference and in the offline data of ``hf-treespec train nde-data``, through :func:`root_features`)
come in named sets (:data:`FEATURE_SETS`, recorded as ``feature_set`` in the selector's config):

- ``root`` (the default, and what the shipped selector reads): the target's pre-norm last hidden state at the root's
  parent (standardised per dimension, projected, LayerNorm); and standardised scalars: entropy and top-1 probability
  of the target distribution p at the parent, log p(root), entropy and top-4 probabilities of the draft distribution
  q at the root, log context length, temperature and top-p. The log measured draft / target forward times are added
  only with ``hf-treespec train nde --latency-features``.
- ``paper`` (Appendix E): ``root`` plus the drafter's pre-norm last hidden state at the root (captured in the draft
  forward the tree makes anyway), KL(p || q), KL(q || p) and the L1 distance between p and q at the root's parent, and
  the latency features. q at the parent is the draft distribution the previous tree recorded there, or one extra
  one-node draft forward on that tree (before the drafter commits) when the parent was a leaf, the paper's "extra
  draft forward pass is relatively cheap"; the first step of a generation has none (its divergences are imputed with
  the training mean). In the offline data q at the parent is drafted from the true context, as at a root. The paper's
  third hidden block, the draft state at the parent, is left out: the recorded q at an expanded parent comes without
  the drafter's state, and re-running the drafter there would cost a forward per step.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..randomness import Randomness
from ..step_context import StepContext
from ..tree import DraftTree, Regime
from .base import POLICIES, Draft, DraftSource, Growth, LogprobsRequest, TreePolicy
from .iid import grow_iid
from .nde_features import (  # noqa: F401  (re-exported: the features' public names)
    DIVERGENCE_FEATURES, FEATURE_SETS, HIDDEN_FEATURES, LATENCY_FEATURES, SCALAR_FEATURES, FeatureSet,
    capture_draft_hidden, context_features, divergences, drafter_last_layer, root_features,
)
from .nde_selector import (  # noqa: F401  (re-exported: the selector's public names)
    HOW_TO_TRAIN, SELECTOR_SUBFOLDER, SELECTOR_TYPE, Action, DelaySelector, DelaySelectorConfig, action_space,
    load_selector,
)

if TYPE_CHECKING:
    from ..drafters.base import Drafter

# ------------------------------------------------------------------------------------------------------ policy
@dataclass(frozen=True)
class HiddenLogprobsRequest(LogprobsRequest):
    """`LogprobsRequest` that also captures the drafter's pre-norm last hidden state at ``nodes`` (selectors that
    read ``draft_hidden``); answered with ``(logprobs, hidden)`` from a source that exposes its drafter. One row
    only: never batched."""

    def answer(self, source: DraftSource) -> tuple[torch.Tensor, torch.Tensor]:
        drafter = getattr(source, "drafter", None)
        if drafter is None:
            raise ValueError("this delay selector reads the drafter's hidden state: its draft source must expose "
                             "the drafter (`.drafter`), as generate's does.")
        with capture_draft_hidden(drafter) as seen:
            logprobs = source.logprobs(self.tree, self.nodes)
        if not seen:  # a compiled drafter's graph does not run the module's hooks
            raise ValueError("this delay selector reads the drafter's hidden state, which a compiled drafter does "
                             "not expose to hooks; decode with disable_compile=True, or use a selector without "
                             "'draft_hidden' in its hidden_inputs.")
        return logprobs, seen[-1]


@dataclass(frozen=True)
class KeepSourceRequest:
    """Answered with the row's `DraftSource` itself (no forward): a selector that reads q at the root's parent drafts
    it in ``observe`` on the verified tree, before the drafter commits (one row only; `NDEPolicy.setup` refuses a
    batch)."""

    def answer(self, source: DraftSource) -> DraftSource:
        return source


def grow_delayed(
    tree: DraftTree, action: Action, record: bool, generator: Randomness = None, first: torch.Tensor | None = None
) -> Generator[Any, Any, DraftTree]:
    """Grows a delayed tree of shape ``action`` from the root of ``tree`` (the ``delayed`` policy's construction);
    ``first``: q(. | root) when already drafted."""
    one = torch.ones(1, dtype=torch.long, device=tree.device)
    tree, tip = yield from grow_iid(tree, one - 1, one, action.trunk, record, generator, first=first)
    first_branch = first if action.trunk == 0 else None  # an empty trunk: the branches start from the root
    tree, _ = yield from grow_iid(tree, tip, one * action.paths, action.branch, record, generator, first=first_branch)
    return tree


@POLICIES.register("nde")
class NDEPolicy(TreePolicy):
    """Delayed expansion with the (k, l1, l2) of each step chosen by a trained :class:`DelaySelector`
    (``tree_selector``: its folder, or the module itself). Without ``tree_selector``, the selector that ships with
    the assistant model is used: ``delay_selector/`` inside the folder it was loaded from (the shipped SmolLM2
    drafter, ``hf_treespec.assets.default_drafter``, has one). A selector is trained on one drafter's trees for one
    target, so it travels with the drafter rather than living in a global default."""

    defaults: ClassVar[dict[str, Any]] = {"tree_selector": None}
    regime = Regime.IID
    default_verifier = "specinfer"

    @classmethod
    def defaults_from_drafter(cls, drafter: "Drafter") -> dict[str, Any]:
        folder = drafter.bundled_path(SELECTOR_SUBFOLDER)
        return {} if folder is None else {"tree_selector": str(folder)}

    def validate(self) -> None:
        super().validate()
        if self.params.get("tree_selector") is None:
            raise ValueError(
                "tree_policy='nde' needs a trained delay selector: pass tree_selector=..., or use an assistant model "
                f"loaded from a folder that ships one in {SELECTOR_SUBFOLDER}/ (as the drafter of "
                "hf_treespec.assets.default_drafter(model) does). " + HOW_TO_TRAIN
            )
        self.selector = load_selector(self.params["tree_selector"])
        wanted = set(self.selector.config.hidden_inputs) - set(HIDDEN_FEATURES)
        if wanted:
            raise ValueError(f"the selector reads hidden inputs {sorted(wanted)} that the nde policy cannot provide.")
        self._scalar_index = [SCALAR_FEATURES.index(n) for n in self.selector.config.scalar_features]

    @property
    def is_chain(self) -> bool:
        return all(a.paths == 1 for a in self.selector.actions)

    @property
    def needs_target_hidden(self) -> bool:
        return "target_hidden" in self.selector.config.hidden_inputs

    @property
    def needs_draft_hidden(self) -> bool:
        return "draft_hidden" in self.selector.config.hidden_inputs

    @property
    def needs_parent_q(self) -> bool:
        """Whether the selector reads p / q divergences at the root's parent (q there is kept from the last step)."""
        return any(n in DIVERGENCE_FEATURES for n in self.selector.config.scalar_features)

    @property
    def context_needs(self) -> frozenset[str]:
        """Latencies and the target's probabilities always (selector features); its hidden state when the selector
        reads it."""
        needs = {"latencies", "target_probs"}
        return frozenset(needs | {"target_hidden"} if self.needs_target_hidden else needs)

    def setup(self, setup) -> None:
        super().setup(setup)
        self._last: tuple[DraftTree, DraftSource] | None = None  # the last tree built and its source
        self._parent_q: torch.Tensor | None = None
        if setup.batch > 1 and (self.needs_draft_hidden or self.needs_parent_q):
            raise ValueError(f"this delay selector (feature_set={self.selector.config.feature_set!r}) reads the "
                             "drafter's state, which batched decoding does not keep per row; decode one sequence "
                             "at a time or use a selector trained with feature_set='root'.")

    def observe(self, outcome) -> None:
        """Keeps q at the accepted path's end (the next root's parent) for the divergence features: the recorded
        q when the tree expanded that node, else one draft forward on it before the drafter commits."""
        super().observe(outcome)
        if not self.needs_parent_q:
            return
        last, self._last, self._parent_q = getattr(self, "_last", None), None, None
        if last is None or last[0] is not outcome.trees[0]:
            return  # a draft-free step (no tree of ours): the next step goes without q at its parent
        tree, source = last
        node = int(outcome.accepted[0][-1])
        if tree.q_index is not None and int(tree.q_index[node]) >= 0:
            self._parent_q = tree.draft_q(node)
        else:
            self._parent_q = source.logprobs(tree, torch.tensor([node]))[0].exp()

    def choose(self, context: StepContext, draft_probs: torch.Tensor,
               draft_hidden: torch.Tensor | None = None) -> Action:
        """The selector's action for this root (``draft_probs``: q(. | root); ``draft_hidden``: the drafter's state
        there, for selectors that read it)."""
        device = next(self.selector.parameters()).device
        parent_q = getattr(self, "_parent_q", None) if self.needs_parent_q else None
        scalars = context_features(context, draft_probs, parent_q)[self._scalar_index].to(device)
        hidden = {}
        if self.needs_target_hidden:
            if context.target_hidden is None:
                raise ValueError("this delay selector reads the target's hidden state at the root's parent, but the "
                                 "step context carries none.")
            hidden["target_hidden"] = context.target_hidden.detach().float().to(device)
        if self.needs_draft_hidden:
            if draft_hidden is None:
                raise ValueError("this delay selector reads the drafter's hidden state at the root; pass it.")
            hidden["draft_hidden"] = draft_hidden.detach().float().to(device)
        return self.selector.select(scalars, **hidden)

    def grow(
        self, root_token: int, *, context: StepContext, capabilities: frozenset[str] = frozenset(),
        generator: Randomness = None,
    ) -> Growth:
        if context.target_probs is None:
            raise ValueError("tree_policy='nde' picks each tree's shape from the target's probabilities at the "
                             "root's parent: use it through generate(), or pass StepContext(target_probs=...) when "
                             "calling build by hand.")
        tree = DraftTree.root(root_token, regime=self.regime)
        root = torch.zeros(1, dtype=torch.long)
        draft_hidden = None
        if self.needs_draft_hidden:
            root_logprobs, draft_hidden = yield HiddenLogprobsRequest(tree, root)
        else:
            root_logprobs = yield LogprobsRequest(tree, root)
        root_q = root_logprobs[0].exp()
        action = self.choose(context, root_q) if draft_hidden is None else self.choose(context, root_q, draft_hidden)
        tree = yield from grow_delayed(tree, action, self.do_sample, generator, first=root_logprobs)
        if self.needs_parent_q:
            self._last = (tree, (yield KeepSourceRequest()))
        return Draft(tree)
