"""GTO -- Group Tree Optimization (Hu et al. 2025; docs/algorithms.md): train the drafter on the expected
acceptance length of the trees it drafts with the decoding policy, not on a single greedy path.

Per training micro-batch (rows of prepared data, as for the other drafter trainers):

1. The collator samples ``num_groups`` (K) windows of ``group_size`` (m) adjacent positions per row whose next token
   is an assistant token.
2. At every sampled position the *current* drafter grows its decoding tree (EAGLE-2 top-k / budget / depth), and so
   does the frozen *reference* drafter (a copy of the initial drafter), all positions in lockstep
   (:func:`.tree_rollout.grow_drafter_trees`).
3. The target scores every tree node online (:func:`.tree_rollout.score_trees`: a forward over the prefix and one
   over the trees' internal nodes). The trees change every step, so stored target data cannot score them exactly.
4. Reward per tree: ``r = (1/eta) logsumexp(eta L_i)`` over its root-to-leaf sequences, ``L_i = sum_j prod_{k<=j}
   p_target(x_k | prefix, x_<k)`` (indicators of the target argmax at ``reward_temperature=0``). Debiased
   ``R = r(T) - r(T_ref)``, standardised within each window: ``A = (R - mean) / (std + delta)``.
5. Ratio along the longest (greedy-)accepted sequence ``S`` of the current tree, of length ``l``:
   ``s = exp((log M(S) - log M0(S)) / max(l, 1))`` (the drafter's log-likelihood with gradients, through the
   training-time unroll of :func:`.unroll.unroll`); PPO surrogate ``L_GTO = -(1/m) sum_i min(s A, clip(s) A)`` per
   window.
6. Loss ``L_token + omega * L_GTO``; ``L_token`` is the EAGLE-3 soft cross-entropy to the target at every scored
   position. Both terms are averaged over the whole gradient-accumulation window (scored positions for ``L_token``,
   windows for ``L_GTO``), so accumulation gives the update of the full batch.

"Longest accepted sequence" at temperature > 0 is not defined in the paper: we use the longest path whose every token
is the target's argmax (the sequence accepted at temperature 0, the mode of acceptance otherwise).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hf_treespec.api import check_tree_attention, POLICIES, DraftTree, Regime

from ..data.collators import DrafterCollator
from .losses import soft_cross_entropy
from .metrics import BatchMetrics
from .trainer import DrafterTrainer, DrafterTrainingArguments
from .tree_rollout import grow_drafter_trees, score_trees
from .unroll import TreeLevels, masked_rows, take_rows, unroll

#: smooth-max of the sequences' expected acceptance lengths ``L`` (log-sum-exp; max / mean ablations)
REWARD_AGGREGATIONS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "logsumexp": lambda lengths, eta: torch.logsumexp(eta * lengths, dim=0) / eta,
    "max": lambda lengths, eta: lengths.max(),
    "mean": lambda lengths, eta: lengths.mean(),
}


# ------------------------------------------------------------------------------------------------------ config
@dataclass
class GTOConfig(DrafterTrainingArguments):
    """GTO's settings with the paper's defaults (Appendix B): AdamW (0.9, 0.95), lr 5e-6 after 1000 warm-up steps,
    gradient clipping 0.5; trees of the decoding policy (EAGLE-2, top-k 10, 60 tokens, depth 7). On a CPU, smaller
    trees / fewer windows keep a step affordable."""

    learning_rate: float = field(default=5e-6, metadata={"help": "peak learning rate"})
    warmup_steps: float = field(default=1000, metadata={"help": "linear warm-up steps (int) or ratio (< 1)"})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "decay after the warm-up"})
    max_grad_norm: float = field(default=0.5, metadata={"help": "gradient clipping"})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    eta: float = field(default=1.0, metadata={"help": "smooth-max temperature of the tree reward"})
    num_groups: int = field(default=16, metadata={"help": "K: windows of adjacent positions per sequence"})
    group_size: int = field(default=8, metadata={"help": "m: positions per window (advantages standardised within)"})
    omega: float = field(default=0.5, metadata={"help": "weight of L_GTO in L_token + omega * L_GTO"})
    token_loss_weight: float = field(default=1.0, metadata={"help": "weight of L_token (0 = GTO alone)"})
    clip_epsilon: float = field(default=0.2, metadata={"help": "PPO clip range of the likelihood ratio"})
    advantage_eps: float = field(default=1e-4, metadata={"help": "delta in A = (R - mean) / (std + delta)"})
    tree_policy: str = field(default="eagle2", metadata={"help": "decoding policy the trees are grown with"})
    tree_topk: int = field(default=10, metadata={"help": "children per expanded node / beam width"})
    tree_budget: int = field(default=60, metadata={"help": "draft tokens kept per tree"})
    tree_depth: int = field(default=7, metadata={"help": "maximum tree depth"})
    reward_aggregation: str = field(default="logsumexp",
                                    metadata={"help": "logsumexp (paper), max or mean over the tree's sequences"})
    debias: bool = field(default=True, metadata={"help": "subtract the reference drafter's tree reward"})
    reward_temperature: float = field(
        default=1.0, metadata={"help": "target temperature of the acceptance probabilities (0 = argmax indicators)"})
    target_chunk_tokens: int = field(default=512, metadata={"help": "tree tokens per row in one target forward"})

    def __post_init__(self):
        super().__post_init__()
        if self.reward_aggregation not in REWARD_AGGREGATIONS:
            raise ValueError(f"reward_aggregation must be one of {sorted(REWARD_AGGREGATIONS)}, got "
                             f"{self.reward_aggregation!r}.")
        for name in ("num_groups", "group_size", "tree_topk", "tree_budget", "tree_depth", "target_chunk_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.eta <= 0:
            raise ValueError(f"eta must be > 0 (the smooth-max temperature), got {self.eta}.")
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {self.clip_epsilon}.")
        if self.omega < 0 or self.token_loss_weight < 0 or self.reward_temperature < 0 or self.advantage_eps <= 0:
            raise ValueError("omega, token_loss_weight and reward_temperature must be >= 0 and advantage_eps > 0.")
        self.make_policy()  # unknown policies / parameters fail here

    def make_policy(self):
        cls = POLICIES.get(self.tree_policy)
        if cls.regime != Regime.DETERMINISTIC:
            raise ValueError(f"GTO grows deterministic trees (the tree decoded at temperature 0); tree_policy="
                             f"{self.tree_policy!r} samples its children. Use eagle2 (the paper's) or chain.")
        wanted = {"tree_topk": self.tree_topk, "tree_budget": self.tree_budget, "tree_depth": self.tree_depth}
        return cls(do_sample=False, **{k: v for k, v in wanted.items() if k in cls.defaults})


# ------------------------------------------------------------------------------------------------------ rewards
def cumulative_acceptance(tree: DraftTree, accept: torch.Tensor) -> torch.Tensor:
    """``[n]``: ``prod_{k on root->i, k != root} accept[k]`` (1 at the root)."""
    logs = torch.log(accept[1:].double().clamp(min=0)).clamp(min=-1e4)
    return torch.exp(tree.ancestor_mask()[:, 1:].double() @ logs).float()


def sequence_acceptance(tree: DraftTree, accept: torch.Tensor) -> torch.Tensor:
    """Expected acceptance length ``L_i`` of every root-to-leaf sequence: ``sum_j prod_{k<=j} accept``."""
    chained = cumulative_acceptance(tree, accept)
    leaves = tree.num_children() == 0
    return tree.ancestor_mask()[leaves][:, 1:].float() @ chained[1:]


def tree_reward(tree: DraftTree, accept: torch.Tensor, eta: float = 1.0, aggregation: str = "logsumexp"
                ) -> torch.Tensor:
    """Tree reward: the ``aggregation`` of the sequences' expected acceptance lengths (a root-only tree: 0)."""
    return REWARD_AGGREGATIONS[aggregation](sequence_acceptance(tree, accept), eta)


def longest_accepted(tree: DraftTree, greedy: torch.Tensor) -> int:
    """The deepest node whose whole path is accepted (``greedy`` per node; ties: best draft score); 0 = none."""
    rejected = (~greedy[1:].bool()).float()
    accepted = (tree.ancestor_mask()[:, 1:].float() @ rejected) == 0
    key = torch.where(accepted, tree.depth.double() * 1e6 + tree.scores.double(), torch.tensor(float("-inf"),
                                                                                                dtype=torch.double))
    return int(key.argmax())


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``[G, m]`` rewards -> advantages standardised within each group (population std)."""
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: ``min(s A, clip(s, 1 - eps, 1 + eps) A)`` and where the clipped term is the one that counts."""
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon)
    objective = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon) & (advantages > 0))
    return objective, clipped


def path_levels(rows: torch.Tensor, columns: torch.Tensor, paths: torch.Tensor, lengths: torch.Tensor,
                batch: int) -> tuple[TreeLevels, torch.Tensor]:
    """Chains ``paths[i, :lengths[i]]`` hanging off drafter column ``columns[i]`` of row ``rows[i]`` as
    :class:`~.unroll.TreeLevels` (level d holds every chain's d-th token), and each chain's slot within its row."""
    count = rows.numel()
    per_row = torch.bincount(rows, minlength=batch)
    local = torch.arange(count) - (per_row.cumsum(0) - per_row)[rows]
    width, depth = int(per_row.max()), int(lengths.max())
    size = width * depth
    tokens = torch.zeros(batch, size, dtype=torch.long)
    parents = torch.full((batch, size), -1, dtype=torch.long)
    roots = torch.zeros(batch, size, dtype=torch.long)
    depths = torch.zeros(batch, size, dtype=torch.long)
    valid = torch.zeros(batch, size, dtype=torch.bool)
    for level in range(depth):
        slot = level * width + local
        tokens[rows, slot] = paths[:, level]
        parents[rows, slot] = (level - 1) * width + local if level else -1
        roots[rows, slot] = columns
        depths[rows, slot] = level + 1
        valid[rows, slot] = level < lengths
    bounds = torch.tensor([[d * width, (d + 1) * width] for d in range(depth)], dtype=torch.long).reshape(-1, 2)
    return TreeLevels(tokens, parents, roots, depths, valid, bounds), local


def frozen_copy(drafter, target=None):
    """A frozen copy of a feature drafter (its own weights; the target's shared modules re-attached, not copied)."""
    ref = type(drafter)(copy.deepcopy(drafter.config))
    ref.load_state_dict(drafter.state_dict())
    ref.to(device=drafter.device, dtype=drafter.dtype)
    if not ref.is_attached:
        if target is None:
            raise ValueError("the drafter shares the target's modules: pass the target to re-attach them.")
        ref.tie_to_target(target)
    return ref.requires_grad_(False).eval()


# ------------------------------------------------------------------------------------------------------ collator
@dataclass
class GTOCollator(DrafterCollator):
    """The context batch (``L_token`` at every scored position) plus the full ``sequence_ids`` / ``sequence_lengths``
    (the target's online forward) and ``group_positions [B, K, m]`` / ``group_valid [B, K]``: up to ``num_groups``
    non-overlapping windows of ``group_size`` adjacent sequence positions ``s >= 1`` whose next token is an assistant
    token, drawn with a generator seeded by ``seed`` and the row's id (the same windows whatever the batching)."""

    num_groups: int = 16
    group_size: int = 8
    seed: int = 0

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.context_batch(rows)
        batch["labels"] = torch.where(batch["context_mask"], 1, -100)
        lengths = torch.tensor([len(row["input_ids"]) for row in rows])
        sequence = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
        positions = torch.zeros(len(rows), self.num_groups, self.group_size, dtype=torch.long)
        valid = torch.zeros(len(rows), self.num_groups, dtype=torch.bool)
        for b, row in enumerate(rows):
            sequence[b, : lengths[b]] = torch.tensor(row["input_ids"], dtype=torch.long)
            starts = self.windows(torch.tensor(row["loss_mask"], dtype=torch.bool), str(row.get("id", b)))
            positions[b, : len(starts)] = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(self.group_size)
            valid[b, : len(starts)] = True
        batch.update(sequence_ids=sequence, sequence_lengths=lengths, group_positions=positions, group_valid=valid)
        return batch

    def windows(self, loss_mask: torch.Tensor, key: str) -> list[int]:
        """Sorted starts of the sampled windows."""
        n, m = loss_mask.numel(), self.group_size
        root = torch.zeros(n, dtype=torch.bool)
        root[1: n - 1] = loss_mask[2:]  # position s is a root when token s + 1 is an assistant token
        runs = torch.nn.functional.pad(root.long().cumsum(0), (1, 0))
        starts = ((runs[m:] - runs[:-m]) == m).nonzero().squeeze(-1) if n >= m else torch.zeros(0, dtype=torch.long)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        taken = torch.zeros(n + m, dtype=torch.bool)
        chosen: list[int] = []
        for start in starts[torch.randperm(starts.numel(), generator=generator)].tolist():
            if not bool(taken[start: start + m].any()):
                taken[start: start + m] = True
                chosen.append(start)
                if len(chosen) == self.num_groups:
                    break
        return sorted(chosen)


# ------------------------------------------------------------------------------------------------------ trainer
class GTOTrainer(DrafterTrainer):
    """Group Tree Optimization (see the module docstring). Needs the target itself (``target_model=``): it scores the
    drafter's trees online. ``ref_model`` defaults to a frozen copy of ``model`` as passed in (the drafter GTO starts
    from, e.g. the shipped one); on ``resume_from_checkpoint`` pass the same initial drafter again."""

    config_class = GTOConfig
    collator_class = GTOCollator
    objective_name = "gto"

    def __init__(self, model, args: GTOConfig | None = None, *, target_model=None, ref_model=None, **kwargs):
        if target_model is None:
            raise ValueError("GTOTrainer scores the drafter's trees with the target online: pass target_model=.")
        if ref_model is None:
            ref_model = frozen_copy(model.tie_to_target(target_model) if not model.is_attached else model,
                                    target_model)
        super().__init__(model, args, target_model=target_model, **kwargs)
        for module, role in ((target_model, "target"), (model, "drafter"), (ref_model, "reference drafter")):
            check_tree_attention(module, role=role)
        self.target_model = target_model.to(self.args.device).eval()
        self.ref_model = ref_model.requires_grad_(False).eval().to(self.args.device)
        self.policy = self.args.make_policy()
        self._window_groups: torch.Tensor | None = None

    @classmethod
    def make_collator(cls, prepared, args: GTOConfig) -> GTOCollator:
        return cls.collator_class.from_prepared(prepared, num_groups=args.num_groups, group_size=args.group_size,
                                                seed=args.seed)

    # --------------------------------------------------------------------------------- accumulation window counts
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Also counts the GTO windows of the whole accumulation window (``L_GTO`` is averaged over them)."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        groups = torch.tensor(sum(int(b["group_valid"].sum()) for b in batches if "group_valid" in b), device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            groups = self.accelerator.gather(groups).sum()
        self._window_groups = groups
        return batches, num_items

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        terms = self.gto_terms(model, inputs)
        args = self.args
        windowed = num_items_in_batch is not None
        token_items = num_items_in_batch if windowed else max(terms["token_items"], 1)
        groups = (self._window_groups if windowed and model.training and self._window_groups is not None
                  else torch.tensor(terms["groups"]))
        loss = args.token_loss_weight * terms["token_sum"] / token_items
        loss = loss + args.omega * terms["gto_sum"] / groups.clamp(min=1).to(terms["gto_sum"].device)
        self.loss_is_scaled_for_ga = windowed
        if windowed and args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients; counts were summed
        self.record(model, terms["metrics"])
        return (loss, {"loss": loss.detach()}) if return_outputs else loss

    # ------------------------------------------------------------------------------------------------- objective
    def gto_terms(self, model, inputs) -> dict[str, Any]:
        """``token_sum`` / ``token_items`` (L_token), ``gto_sum`` (sum over windows of L_GTO), ``groups`` and the
        logged metrics ``{name: (sum, count)}`` of one micro-batch."""
        args, drafter = self.args, self.drafter(model)
        context = (inputs["input_ids"], inputs["target_hidden_states"], inputs["attention_mask"])
        valid = inputs["group_valid"].cpu()
        row_index, group_index = valid.nonzero(as_tuple=True)
        positions = inputs["group_positions"].cpu()[row_index, group_index]  # [G, m]
        groups, m = positions.shape
        rows = row_index[:, None].expand(-1, m).reshape(-1)
        roots = positions.reshape(-1)
        metrics = BatchMetrics()
        levels = None
        if groups:
            count = rows.numel()
            trees = grow_drafter_trees(drafter, *context, rows, roots, self.policy, args.tree_topk)
            # without debiasing (the ablation) the reference's trees are not needed
            ref_trees = (grow_drafter_trees(self.ref_model, *context, rows, roots, self.policy, args.tree_topk)
                         if args.debias else [])
            scored = trees + ref_trees
            copies = len(scored) // count
            accept = score_trees(self.target_model, inputs["sequence_ids"].cpu(), inputs["sequence_lengths"].cpu(),
                                 scored, rows.repeat(copies), roots.repeat(copies), args.reward_temperature,
                                 args.target_chunk_tokens)
            rewards = torch.stack([tree_reward(tree, acc.at(args.reward_temperature), args.eta,
                                               args.reward_aggregation) for tree, acc in zip(scored, accept)])
            nodes = [longest_accepted(tree, acc.greedy) for tree, acc in zip(scored, accept)]
            accepted = torch.tensor([int(tree.depth[node]) for tree, node in zip(scored, nodes)])
            reward, lengths = rewards[:count], accepted[:count]
            metrics.add("reward", reward)
            metrics.add("accepted_length", lengths.float())
            if args.debias:
                debiased = reward - rewards[count:]
                metrics.add("ref_reward", rewards[count:])
                metrics.add("debiased_reward", debiased)
                metrics.add("ref_accepted_length", accepted[count:].float())
            advantages = group_advantages((debiased if args.debias else reward).view(groups, m), args.advantage_eps)
            paths = torch.zeros(count, max(int(lengths.max()), 1), dtype=torch.long)
            for i, (tree, node) in enumerate(zip(trees, nodes)):
                paths[i, : lengths[i]] = tree.paths()[node, 1: int(lengths[i]) + 1]
            levels, local = chain_levels(rows, roots - 1, paths, lengths, inputs["input_ids"].shape[0],
                                         inputs["input_ids"].device)
        out = unroll(model, *context, levels)
        picked = masked_rows(inputs["context_mask"])  # one read of the mask for both arrays
        logp = self.target_logp(model, take_rows(inputs["label_hidden"], picked))
        ce = soft_cross_entropy(logp, take_rows(out.context_logits, picked))
        metrics.add("token_ce", ce)
        gto_sum = out.context_logits.sum() * 0.0
        if groups:
            chains = (rows, roots - 1, local, paths, lengths)
            log_m = path_logprob(drafter, out, levels, *chains)
            with torch.no_grad():
                log_m0 = path_logprob(self.ref_model, unroll(self.ref_model, *context, levels), levels, *chains)
            ratio = torch.exp((log_m - log_m0) / lengths.clamp(min=1).to(log_m.device))
            objective, clipped = clipped_surrogate(ratio.view(groups, m), advantages.to(ratio.device),
                                                   args.clip_epsilon)
            gto_sum = -objective.mean(-1).sum()
            metrics.add("clip_fraction", clipped.float())
            metrics.add("ratio", ratio)
            metrics.add("gto_loss", gto_sum, groups)
        return {"token_sum": ce.sum(), "token_items": ce.numel(), "gto_sum": gto_sum, "groups": groups,
                "metrics": metrics,
                "advantages": advantages if groups else None, "chains": (levels, *chains) if groups else None}


def path_logprob(drafter, out, levels: TreeLevels | None, rows: torch.Tensor, columns: torch.Tensor,
                 local: torch.Tensor | None, paths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[P]``: the drafter's log-likelihood ``sum_d log q(paths[i, d] | prefix, paths[i, :d])`` of every chain, from
    an :func:`~.unroll.unroll` over ``chain_levels(...)`` (the context logits at the root give the first token, the
    output at the chain's ``d``-th node the ``d+1``-th)."""
    device = out.context_logits.device
    rows, columns, lengths = rows.to(device), columns.to(device), lengths.to(device)
    ids = drafter.draft_labels(paths.to(device))
    steps = torch.arange(ids.shape[1], device=device)[None, :] < lengths[:, None]
    logits = out.context_logits[rows, columns][:, None]
    if levels is not None:
        width = int(levels.bounds[0, 1] - levels.bounds[0, 0])
        nodes = out.node_logits.view(out.node_logits.shape[0], -1, width, out.node_logits.shape[-1])
        logits = torch.cat([logits, nodes[rows, :, local.to(device)]], dim=1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    taken = logp.gather(-1, ids[:, : logp.shape[1]].clamp(min=0)[..., None])[..., 0]
    keep = steps[:, : logp.shape[1]] & (ids[:, : logp.shape[1]] >= 0)
    return torch.where(keep, taken, torch.zeros_like(taken)).sum(-1)


def chain_levels(rows: torch.Tensor, columns: torch.Tensor, paths: torch.Tensor, lengths: torch.Tensor, batch: int,
                 device: torch.device | None = None) -> tuple[TreeLevels | None, torch.Tensor | None]:
    """The unroll input that scores whole chains: every chain token but the last is a node (its output predicts the
    next token); None when every chain has at most one token (the context pass scores it)."""
    inner = (lengths - 1).clamp(min=0)
    if int(inner.max()) == 0:
        return None, None
    levels, local = path_levels(rows, columns, paths[:, : int(inner.max())], inner, batch)
    return TreeLevels(*(getattr(levels, f).to(device) for f in (
        "tokens", "parents", "roots", "depth", "valid", "bounds"))), local
