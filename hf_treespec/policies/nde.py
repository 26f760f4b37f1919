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

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from ..randomness import Randomness
from ..tree import DraftTree, Regime
from .base import POLICIES, DraftSource, TreePolicy
from .helper_model import HelperModelMixin
from ..step_context import StepContext
from .iid import grow_iid

if TYPE_CHECKING:
    from ..drafters.base import Drafter

SELECTOR_TYPE = "treespec_delay_selector"
#: subfolder of a drafter checkpoint holding the selector trained for that drafter (used when tree_selector is unset)
SELECTOR_SUBFOLDER = "delay_selector"

#: scalar root features, in the order :func:`root_features` returns them
SCALAR_FEATURES: tuple[str, ...] = (
    "target_entropy", "target_top1", "root_target_logprob",
    "draft_entropy", "draft_top1", "draft_top2", "draft_top3", "draft_top4",
    "log_context_length", "temperature", "top_p", "log_draft_seconds", "log_target_seconds",
    "kl_target_draft", "kl_draft_target", "l1_target_draft",
)
#: the measured-latency features: hardware-aware, but on one machine they vary only with the context length
LATENCY_FEATURES: tuple[str, ...] = ("log_draft_seconds", "log_target_seconds")
#: p / q divergences at the root's parent (they need q there: see the module docstring)
DIVERGENCE_FEATURES: tuple[str, ...] = ("kl_target_draft", "kl_draft_target", "l1_target_draft")
#: hidden-state inputs the policy can provide
HIDDEN_FEATURES: tuple[str, ...] = ("target_hidden", "draft_hidden")
_LOG_FLOOR = -30.0
_PROB_FLOOR = 1e-10  # q floor inside the KL: warping (top-p) zeroes tokens the other side still has


@dataclass(frozen=True)
class FeatureSet:
    """A named choice of selector inputs: scalar features (from :data:`SCALAR_FEATURES`) and hidden-state blocks
    (from :data:`HIDDEN_FEATURES`)."""

    name: str
    scalars: tuple[str, ...]
    hidden: tuple[str, ...]


_ROOT_SCALARS = tuple(n for n in SCALAR_FEATURES if n not in LATENCY_FEATURES + DIVERGENCE_FEATURES)
#: ``root``: ours (no draft hidden state, no divergences, latencies opt-in); ``paper``: Appendix E's list
FEATURE_SETS: dict[str, FeatureSet] = {
    "root": FeatureSet("root", _ROOT_SCALARS, ("target_hidden",)),
    "paper": FeatureSet("paper", _ROOT_SCALARS + DIVERGENCE_FEATURES + LATENCY_FEATURES,
                        ("target_hidden", "draft_hidden")),
}

HOW_TO_TRAIN = (
    "Make one with `hf-treespec train nde-data --drafter <drafter> --output runs/nde/data ...` (offline block-"
    "efficiency estimates) and `hf-treespec train nde --data runs/nde/data --output-dir runs/nde`, then pass "
    f"tree_selector='runs/nde' (or copy it to <drafter folder>/{SELECTOR_SUBFOLDER}/ to make it that drafter's "
    "default). Without a selector, tree_policy='delayed' takes a fixed delay_trunk / tree_paths / delay_branch."
)


class Action(NamedTuple):
    """One delayed-expansion shape: k i.i.d. paths of l2 tokens after a sampled trunk of l1 tokens."""

    paths: int  # k
    trunk: int  # l1
    branch: int  # l2

    @property
    def max_nodes(self) -> int:
        """Draft nodes when no two paths coincide (the root excluded)."""
        return self.trunk + self.paths * self.branch

    def checked(self) -> "Action":
        """Itself, after refusing shapes no tree has (k < 1, l1 < 0, l2 < 1)."""
        if self.paths < 1 or self.trunk < 0 or self.branch < 1:
            raise ValueError(f"bad action {tuple(self)}: need k >= 1, l1 >= 0, l2 >= 1.")
        return self


def action_space(
    paths: Iterable[int] = (1, 2, 4, 8), trunks: Iterable[int] = (0, 1, 2, 3, 4), branches: Iterable[int] = (1, 2, 3, 4, 6)
) -> list[Action]:
    """The Cartesian product k x l1 x l2 (the paper's Equation 8) without duplicate trees: with k = 1 every (l1, l2)
    of equal l1 + l2 is the same chain, so only the first such action (in product order) is kept."""
    actions: list[Action] = []
    chains: set[int] = set()
    for k, l1, l2 in product(sorted(set(paths)), sorted(set(trunks)), sorted(set(branches))):
        action = Action(int(k), int(l1), int(l2)).checked()
        if action.paths == 1:
            if action.trunk + action.branch in chains:
                continue
            chains.add(action.trunk + action.branch)
        actions.append(action)
    if not actions:
        raise ValueError("the action space is empty: give at least one k, one l1 and one l2.")
    return actions


# ---------------------------------------------------------------------------------------------------- features
def _entropy(probs: torch.Tensor) -> float:
    logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return float(-(probs * logp).sum())


def _log(value: float | None) -> float:
    return math.log(value) if value is not None and value > 0 else math.nan


def divergences(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """``[3]``: KL(p || q), KL(q || p) and sum |p - q| of two ``[V]`` distributions at one position (the other side
    floored at 1e-10 inside each KL, as warping zeroes different tokens on each side); NaN without ``draft_probs``."""
    if draft_probs is None:
        return torch.full((3,), math.nan)
    p, q = target_probs.detach().float(), draft_probs.detach().float().to(target_probs.device)
    log_p, log_q = p.clamp(min=_PROB_FLOOR).log(), q.clamp(min=_PROB_FLOOR).log()
    kl_pq = torch.where(p > 0, p * (log_p - log_q), 0.0).sum()
    kl_qp = torch.where(q > 0, q * (log_q - log_p), 0.0).sum()
    return torch.stack([kl_pq, kl_qp, (p - q).abs().sum()]).cpu()


def root_features(
    target_probs: torch.Tensor, root_token: int, draft_probs: torch.Tensor, context_length: int, temperature: float,
    top_p: float, draft_seconds: float | None, target_seconds: float | None,
    draft_parent_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[len(SCALAR_FEATURES)]`` float32 scalar features of one root (``target_probs``: p at the root's parent;
    ``draft_probs``: q at the root; ``draft_parent_probs``: q at the parent, for the divergences). Unknown latencies
    and divergences are NaN (the selector replaces them by its training mean)."""
    p = target_probs.detach().float()
    q = draft_probs.detach().float()
    top = q.topk(min(4, q.numel())).values.tolist()
    top += [0.0] * (4 - len(top))
    p_root = float(p[int(root_token)])
    values = [
        _entropy(p), float(p.max()), max(math.log(p_root), _LOG_FLOOR) if p_root > 0 else _LOG_FLOOR,
        _entropy(q), *top,
        math.log(max(int(context_length), 1)), float(temperature), float(top_p),
        _log(draft_seconds), _log(target_seconds),
    ]
    return torch.cat([torch.tensor(values, dtype=torch.float32), divergences(p, draft_parent_probs)])


def context_features(context: StepContext, draft_probs: torch.Tensor,
                     draft_parent_probs: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`root_features` of a decoding step."""
    return root_features(context.target_probs, context.root_token, draft_probs, context.context_length,
                         context.temperature, context.top_p, context.draft_seconds, context.target_seconds,
                         draft_parent_probs)


def drafter_last_layer(drafter: "Drafter") -> nn.Module:
    """The last decoder block of a drafter's model (its output is the drafter's pre-norm last hidden state)."""
    from ..features import decoder_layers

    model = getattr(drafter, "model", None)
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers[-1]
    try:
        return decoder_layers(model)[-1]
    except (ValueError, AttributeError, TypeError) as error:
        raise ValueError(f"the delay selector reads the drafter's hidden state, but {type(drafter).__name__} has no "
                         "decoder layers to read it from (use a selector trained with feature_set='root').") from error


@contextmanager
def capture_draft_hidden(drafter: "Drafter") -> Iterator[list[torch.Tensor]]:
    """Within the block, each drafter forward appends its last block's output at the last input row (the node just
    expanded when one node is expanded at a time) to the yielded list."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        seen.append(out.reshape(-1, out.shape[-1])[-1].detach().float())

    handle = drafter_last_layer(drafter).register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------------- selector
@dataclass
class DelaySelectorConfig:
    """Architecture and action set of a :class:`DelaySelector` (saved as ``config.json``).

    Args:
        actions: the (k, l1, l2) actions the logits index.
        scalar_features: names from :data:`SCALAR_FEATURES` the selector reads, in this order.
        hidden_inputs: hidden-state inputs (names from :data:`HIDDEN_FEATURES`) -> width.
        shared_dim: d, the width every hidden-state block is projected to.
        mlp_hidden: the two hidden layers of the MLP (Appendix E: 512 and 32).
        dropout: dropout after each hidden layer (training only).
        clip: standardised features are clipped to [-clip, clip] (latencies measured online can stray far from
            the microbenchmark of the training data).
        standardised: whether the standardisation statistics were fitted (``fit_standardisation``).
        verifier: the verifier the block-efficiency targets were estimated for.
        baseline_actions: static baseline action per sampling setting (``"T=1.0,top_p=1.0"``) used in training.
        feature_set: name of the :data:`FEATURE_SETS` entry the inputs were chosen from (``root`` for configs saved
            before the field existed); ``scalar_features`` / ``hidden_inputs`` stay the exact inputs read.
    """

    actions: list[list[int]]
    scalar_features: list[str] = field(default_factory=lambda: list(SCALAR_FEATURES))
    hidden_inputs: dict[str, int] = field(default_factory=dict)
    shared_dim: int = 64
    mlp_hidden: list[int] = field(default_factory=lambda: [512, 32])
    dropout: float = 0.1
    clip: float = 5.0
    standardised: bool = False
    verifier: str | None = None
    baseline_actions: dict[str, list[int]] = field(default_factory=dict)
    feature_set: str = "root"
    selector_type: str = SELECTOR_TYPE

    def __post_init__(self) -> None:
        self.actions = [list(Action(*map(int, a)).checked()) for a in self.actions]
        if not self.actions:
            raise ValueError("DelaySelectorConfig.actions is empty.")
        unknown = [n for n in self.scalar_features if n not in SCALAR_FEATURES]
        if unknown:
            raise ValueError(f"unknown scalar features {unknown}; known: {list(SCALAR_FEATURES)}.")
        unknown = [n for n in self.hidden_inputs if n not in HIDDEN_FEATURES]
        if unknown:
            raise ValueError(f"unknown hidden inputs {unknown}; known: {list(HIDDEN_FEATURES)}.")
        if self.feature_set not in FEATURE_SETS:
            raise ValueError(f"unknown feature_set {self.feature_set!r}; known: {sorted(FEATURE_SETS)}.")
        if not self.scalar_features and not self.hidden_inputs:
            raise ValueError("the selector needs at least one scalar feature or hidden input.")
        if len(self.mlp_hidden) != 2 or min(self.mlp_hidden) < 1 or self.shared_dim < 1:
            raise ValueError("mlp_hidden must be two positive sizes and shared_dim positive.")
        if self.selector_type != SELECTOR_TYPE:
            raise ValueError(f"not a delay selector config (selector_type={self.selector_type!r}).")


class DelaySelector(HelperModelMixin, nn.Module):
    """Categorical policy over delayed-expansion actions (Appendix E, Equation 10).

    Every hidden-state input is standardised per dimension (statistics of the training data, stored as buffers),
    projected to ``shared_dim`` and layer-normalised; the scalar features are standardised and clipped; everything
    is concatenated into a two-hidden-layer GELU MLP (with dropout) that outputs one logit per action.
    """

    config_class = DelaySelectorConfig
    type_field = "selector_type"
    type_tag = SELECTOR_TYPE
    kind = "delay selector"
    how_to_train = HOW_TO_TRAIN

    def __init__(self, config: DelaySelectorConfig):
        super().__init__()
        self.config = config
        num_scalars = len(config.scalar_features)
        self.register_buffer("scalar_mean", torch.zeros(num_scalars))
        self.register_buffer("scalar_std", torch.ones(num_scalars))
        self.projections = nn.ModuleDict()
        for name, width in config.hidden_inputs.items():
            self.register_buffer(f"{name}_mean", torch.zeros(width))
            self.register_buffer(f"{name}_std", torch.ones(width))
            self.projections[name] = nn.Sequential(nn.Linear(width, config.shared_dim), nn.LayerNorm(config.shared_dim))
        width = config.shared_dim * len(config.hidden_inputs) + num_scalars
        h1, h2 = config.mlp_hidden
        self.mlp = nn.Sequential(
            nn.Linear(width, h1), nn.GELU(), nn.Dropout(config.dropout),
            nn.Linear(h1, h2), nn.GELU(), nn.Dropout(config.dropout),
            nn.Linear(h2, len(config.actions)),
        )

    @property
    def actions(self) -> list[Action]:
        return [Action(*a) for a in self.config.actions]

    def _standardise(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        z = (x.float() - mean) / std
        return torch.nan_to_num(z, nan=0.0).clamp(-self.config.clip, self.config.clip)

    def forward(self, scalars: torch.Tensor, **hidden: torch.Tensor) -> torch.Tensor:
        """``scalars`` ``[B, len(scalar_features)]`` and one ``[B, width]`` tensor per hidden input -> ``[B, A]``."""
        missing = set(self.config.hidden_inputs) - set(hidden)
        if missing:
            raise ValueError(f"the delay selector needs the hidden inputs {sorted(missing)}.")
        parts = []
        for name, projection in self.projections.items():
            x = hidden[name]
            if x.shape[-1] != self.config.hidden_inputs[name]:
                raise ValueError(f"hidden input {name!r} has width {x.shape[-1]}, the selector was trained on "
                                 f"{self.config.hidden_inputs[name]} (a different target model?).")
            z = self._standardise(x, getattr(self, f"{name}_mean"), getattr(self, f"{name}_std"))
            parts.append(projection(z))
        parts.append(self._standardise(scalars, self.scalar_mean, self.scalar_std))
        return self.mlp(torch.cat(parts, dim=-1))

    @torch.no_grad()
    def fit_standardisation(self, scalars: torch.Tensor, min_std: float = 1e-2, **hidden: torch.Tensor) -> None:
        """Sets the per-feature mean / std from training rows (NaN entries ignored; ``min_std`` floors the std so
        near-constant features, such as latencies on one machine, do not blow up)."""

        def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = x.float()
            valid = ~torch.isnan(x)
            count = valid.sum(0).clamp(min=1)
            mean = torch.where(valid, x, 0.0).sum(0) / count
            var = torch.where(valid, (x - mean) ** 2, 0.0).sum(0) / count
            return mean, var.sqrt().clamp(min=min_std)

        mean, std = stats(scalars)
        self.scalar_mean.copy_(mean)
        self.scalar_std.copy_(std)
        for name in self.config.hidden_inputs:
            mean, std = stats(hidden[name])
            getattr(self, f"{name}_mean").copy_(mean)
            getattr(self, f"{name}_std").copy_(std)
        self.config.standardised = True

    @torch.no_grad()
    def select(self, scalars: torch.Tensor, **hidden: torch.Tensor) -> Action:
        """The action of highest probability for one root (``scalars`` ``[S]``, hidden inputs ``[H]``)."""
        logits = self(scalars[None], **{k: v[None] for k, v in hidden.items()})
        return self.actions[int(logits[0].argmax())]


# ------------------------------------------------------------------------------------------------------ policy
class _PrimedSource(DraftSource):
    """A `DraftSource` whose first answer, q(. | root), is already known (the selector needed it)."""

    def __init__(self, source: DraftSource, root_logprobs: torch.Tensor):
        self.source = source
        self._first: torch.Tensor | None = root_logprobs

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        if self._first is not None:
            if nodes.numel() != 1 or int(nodes[0]) != 0:
                raise RuntimeError("the primed draft source must first be asked for the root")
            first, self._first = self._first, None
            return first
        return self.source.logprobs(tree, nodes)


def grow_delayed(
    tree: DraftTree, source: DraftSource, action: Action, record: bool, generator: Randomness = None
) -> DraftTree:
    """Grows a delayed tree of shape ``action`` from the root of ``tree`` (the ``delayed`` policy's construction)."""
    one = torch.ones(1, dtype=torch.long, device=tree.device)
    tree, tip = grow_iid(tree, source, one - 1, one, action.trunk, record, generator)
    tree, _ = grow_iid(tree, source, tip, one * action.paths, action.branch, record, generator)
    return tree


def load_selector(selector: Any) -> DelaySelector:
    """A :class:`DelaySelector` from the ``tree_selector`` generate kwarg (a folder or a selector)."""
    return DelaySelector.resolve(selector, "tree_selector")


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

    def build(
        self, source: DraftSource, root_token: int, *, context: StepContext, generator: Randomness = None
    ) -> DraftTree:
        if context.target_probs is None:
            raise ValueError("tree_policy='nde' picks each tree's shape from the target's probabilities at the "
                             "root's parent: use it through generate(), or pass StepContext(target_probs=...) when "
                             "calling build by hand.")
        tree = DraftTree.root(root_token, regime=self.regime)
        draft_hidden = None
        if self.needs_draft_hidden:
            drafter = getattr(source, "drafter", None)
            if drafter is None:
                raise ValueError("this delay selector reads the drafter's hidden state: its draft source must expose "
                                 "the drafter (`.drafter`), as generate's does.")
            with capture_draft_hidden(drafter) as seen:
                root_logprobs = source.logprobs(tree, torch.zeros(1, dtype=torch.long))
            draft_hidden = seen[-1]
        else:
            root_logprobs = source.logprobs(tree, torch.zeros(1, dtype=torch.long))
        root_q = root_logprobs[0].exp()
        action = self.choose(context, root_q) if draft_hidden is None else self.choose(context, root_q, draft_hidden)
        tree = grow_delayed(tree, _PrimedSource(source, root_logprobs), action, self.do_sample, generator)
        self._last = (tree, source)
        return tree
