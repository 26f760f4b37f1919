"""The NDE delay selector: the (k, l1, l2) action space and the small network that picks one action per step from
the root features (:mod:`.nde_features`), saved and loaded like a transformers model."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Any, Iterable, NamedTuple

import torch
from torch import nn

from .helper_model import HelperModelMixin
from .nde_features import FEATURE_SETS, HIDDEN_FEATURES, SCALAR_FEATURES  # noqa: F401

SELECTOR_TYPE = "treespec_delay_selector"
#: subfolder of a drafter checkpoint holding the selector trained for that drafter (used when tree_selector is unset)
SELECTOR_SUBFOLDER = "delay_selector"

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


def load_selector(selector: Any) -> DelaySelector:
    """A :class:`DelaySelector` from the ``tree_selector`` generate kwarg (a folder or a selector)."""
    return DelaySelector.resolve(selector, "tree_selector")
