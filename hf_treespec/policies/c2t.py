"""C2T: EAGLE-2-like layer-by-layer trees pruned *before* verification by a tiny classifier (the C2T paper).

Each layer, every frontier node is expanded in one batched draft forward; its ``tree_topk`` most likely children are
the candidates. A two-layer FFN (hidden 48, ReLU, sigmoid) scores each candidate from three properties of the tree
only: its joint draft probability, the entropy of its parent's draft distribution over that distribution's top 1000
tokens, and its depth. Candidates whose confidence exceeds ``c2t_threshold`` (beta) are kept; of those, at most
``c2t_topk`` per layer (highest confidence; the paper's second pruning) become the tree's nodes and the next frontier.
The tree stops at ``tree_depth`` or when no candidate passes. Siblings stay in draft-rank order, and the regime is
deterministic (top-k by draft score), so greedy and NSS verification stay lossless whatever the classifier says.

The classifier is trained for one drafter / target pair (``hf-treespec train c2t-data`` then ``train c2t``) and ships
beside the drafter in ``c2t/`` (like ``delay_selector/``); ``c2t_classifier`` overrides it.

Ablation knobs of the paper's appendix: a classifier may read any non-empty subset of the three features
(``C2TClassifierConfig.features``, Table 1); ``c2t_entropy_top`` replaces the classifier's top-N of the entropy at
decoding time (Table 6; a value >= the vocabulary is the full entropy); ``c2t_topk=0`` drops the second pruning
(Table 5); ``tree_topk=1`` is the paper's chain mode, where C2T is an early exit (Table 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..tree import DraftTree, to_host
from .base import POLICIES, Draft, Growth, LogprobsRequest, TreePolicy
from .helper_model import HelperModelMixin

if TYPE_CHECKING:
    from ..drafters.base import Drafter

CLASSIFIER_TYPE = "treespec_c2t_classifier"
#: subfolder of a drafter checkpoint holding the classifier trained for that drafter (used when c2t_classifier unset)
CLASSIFIER_SUBFOLDER = "c2t"
FEATURES = ("joint_prob", "parent_entropy", "depth")

HOW_TO_TRAIN = (
    "Make one with `hf-treespec train c2t-data --output runs/c2t/data` (full EAGLE-2 trees labelled by the target) "
    "and `hf-treespec train c2t --data runs/c2t/data --output-dir runs/c2t`, then pass c2t_classifier='runs/c2t' (or "
    f"copy it to <drafter folder>/{CLASSIFIER_SUBFOLDER}/ to make it that drafter's default)."
)


def top_entropy(logq: torch.Tensor, top: int = 1000) -> torch.Tensor:
    """``[m]`` -sum p log p over the ``top`` most likely tokens of each row of log-probs ``[m, V]`` (the paper's
    cheap stand-in for the full entropy; the tail beyond the top 1000 carries almost no mass)."""
    values = logq.topk(min(top, logq.shape[-1]), dim=-1).values.float()
    probs = values.exp()
    return -(probs * torch.where(probs > 0, values, torch.zeros_like(values))).sum(-1)


def node_features(joint_logprob: torch.Tensor, parent_entropy: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``[..., 3]`` classifier inputs in :data:`FEATURES` order (the same function builds training rows)."""
    return torch.stack([joint_logprob.float().exp(), parent_entropy.float(), depth.float()], dim=-1)


@dataclass
class C2TClassifierConfig:
    """Architecture of a :class:`C2TClassifier` (saved as ``config.json``). ``features``: which of :data:`FEATURES`
    the network reads (all three by default; a subset for the paper's feature ablation)."""

    hidden_size: int = 48
    entropy_top: int = 1000
    standardised: bool = False
    features: tuple[str, ...] = FEATURES
    classifier_type: str = CLASSIFIER_TYPE

    def __post_init__(self) -> None:
        self.features = tuple(self.features)
        unknown = [f for f in self.features if f not in FEATURES]
        if not self.features or unknown or len(set(self.features)) != len(self.features):
            raise ValueError(f"features must be a non-empty subset of {FEATURES} without repeats, got "
                             f"{self.features}.")
        self.features = tuple(f for f in FEATURES if f in self.features)  # one canonical order
        if self.hidden_size < 1 or self.entropy_top < 1:
            raise ValueError("hidden_size and entropy_top must be >= 1.")
        if self.classifier_type != CLASSIFIER_TYPE:
            raise ValueError(f"not a C2T classifier config (classifier_type={self.classifier_type!r}).")


class C2TClassifier(HelperModelMixin, nn.Module):
    """Two-layer FFN (Linear -> ReLU -> Linear) over standardised features; ``confidence`` applies the sigmoid.

    Inputs are always the full ``[..., 3]`` rows of :func:`node_features`; the network reads the columns its config
    names, so one data set trains every feature subset and the policy never changes."""

    config_class = C2TClassifierConfig
    type_field = "classifier_type"
    type_tag = CLASSIFIER_TYPE
    kind = "C2T classifier"
    how_to_train = HOW_TO_TRAIN

    def __init__(self, config: C2TClassifierConfig | None = None):
        super().__init__()
        self.config = config or C2TClassifierConfig()
        width = len(self.config.features)
        self.register_buffer("columns", torch.tensor([FEATURES.index(f) for f in self.config.features]),
                             persistent=False)
        self.register_buffer("feature_mean", torch.zeros(width))
        self.register_buffer("feature_std", torch.ones(width))
        self.net = nn.Sequential(nn.Linear(width, self.config.hidden_size), nn.ReLU(),
                                 nn.Linear(self.config.hidden_size, 1))

    def select(self, features: torch.Tensor) -> torch.Tensor:
        """The columns of ``[..., 3]`` features (:data:`FEATURES` order) this classifier reads."""
        if features.shape[-1] != len(FEATURES):
            raise ValueError(f"C2T features are [..., {len(FEATURES)}] rows {FEATURES}, got shape "
                             f"{tuple(features.shape)}.")
        return features.float().index_select(-1, self.columns.to(features.device))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., 3]`` features -> ``[...]`` logits."""
        return self.net((self.select(features) - self.feature_mean) / self.feature_std).squeeze(-1)

    @torch.no_grad()
    def confidence(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(features))

    @torch.no_grad()
    def fit_standardisation(self, features: torch.Tensor, min_std: float = 1e-3) -> None:
        """Mean / std of the read columns of ``[n, 3]`` training features."""
        features = self.select(features)
        self.feature_mean.copy_(features.mean(0))
        self.feature_std.copy_(features.std(0).clamp(min=min_std))
        self.config.standardised = True


def load_classifier(classifier: Any) -> C2TClassifier:
    """A :class:`C2TClassifier` from the ``c2t_classifier`` generate kwarg (a folder or a classifier)."""
    return C2TClassifier.resolve(classifier, "c2t_classifier")


@POLICIES.register("c2t")
class C2TPolicy(TreePolicy):
    defaults: ClassVar[dict[str, Any]] = {"c2t_classifier": None, "c2t_threshold": 0.5, "c2t_topk": 15,
                                          "c2t_entropy_top": None, "tree_topk": 10, "tree_depth": 7}

    @classmethod
    def defaults_from_drafter(cls, drafter: "Drafter") -> dict[str, Any]:
        folder = drafter.bundled_path(CLASSIFIER_SUBFOLDER)
        return {} if folder is None else {"c2t_classifier": str(folder)}

    def validate(self) -> None:
        super().validate()
        beta = float(self.params["c2t_threshold"])
        if not 0 < beta < 1:
            raise ValueError(f"c2t_threshold must be in (0, 1) (a classifier confidence), got {beta}.")
        if int(self.params["c2t_topk"]) < 0:
            raise ValueError(f"c2t_topk must be >= 0 (0 = no per-layer cap), got {self.params['c2t_topk']}.")
        top = self.params["c2t_entropy_top"]
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ValueError(f"c2t_entropy_top must be an int >= 1 (None = the classifier's entropy_top), got {top!r}.")
        if self.params["c2t_classifier"] is None:
            raise ValueError(
                "tree_policy='c2t' needs a trained confidence classifier: pass c2t_classifier=..., or use an assistant "
                f"model loaded from a folder that ships one in {CLASSIFIER_SUBFOLDER}/ (as the drafter of "
                "hf_treespec.assets.default_drafter(model) does). " + HOW_TO_TRAIN)
        self.classifier = load_classifier(self.params["c2t_classifier"])

    def grow(self, root_token, *, context, capabilities=frozenset(), generator=None) -> Growth:
        device = torch.device("cpu")  # trees are host bookkeeping (see DraftTree)
        k, depth = int(self.params["tree_topk"]), int(self.params["tree_depth"])
        beta, cap = float(self.params["c2t_threshold"]), int(self.params["c2t_topk"])
        classifier = self.classifier.to(device)
        entropy_top = self.params["c2t_entropy_top"] or classifier.config.entropy_top
        tree = DraftTree.root(root_token, device=device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)
        for level in range(depth):
            logq = yield LogprobsRequest(tree, frontier)
            # entropy and the first top-k on the draft's device; only these [F, k] rows travel to the host tree
            entropy = top_entropy(logq, entropy_top).cpu()
            vals, toks = to_host(*logq.topk(min(k, logq.shape[-1]), dim=-1))  # only these are scored
            joint = tree.scores[frontier][:, None] + vals
            feats = node_features(joint, entropy[:, None].expand_as(joint),
                                  torch.full_like(joint, level + 1))
            conf = classifier.confidence(feats)
            keep = torch.isfinite(vals) & (conf > beta)
            if cap and int(keep.sum()) > cap:  # second top-k: the layer's most confident candidates
                best = torch.where(keep, conf, torch.full_like(conf, -1.0)).flatten().topk(cap).indices
                keep = torch.zeros_like(keep).flatten().index_fill_(0, best, True).view_as(keep)
            rows, cols = keep.nonzero(as_tuple=True)  # row-major: by parent, then draft rank
            if rows.numel() == 0:
                break
            start = tree.num_nodes
            tree = tree.add_children(frontier[rows], toks[rows, cols], vals[rows, cols])
            frontier = torch.arange(start, tree.num_nodes, device=device)
        return Draft(tree)
