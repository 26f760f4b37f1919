"""Offline training data for the NDE delay selector (delayed-expansion paper, Sections 5-6 and Appendix E).

Pipeline per prompt: the target generates a trajectory (plain ``generate`` with the run's sampling settings); a root
is taken every ``root_every`` tokens of the generated text. For every root and every action (k, l1, l2) we store

- the **block efficiency** of Equation 3: 1 + the expected number of accepted draft tokens of a random (k, l1,
  l2)-delayed tree under the chosen top-down verifier. The inner expectation (verification randomness) is exact: a
  node is reached with the product of the verifier's *branching probabilities* (Definition 5.3) along its path, and
  those are computed in closed form from p and q at each node (``BranchingLaw.branching``). The outer expectation (drafting
  randomness) is the mean over ``num_samples`` delayed trees sampled with the drafter, so the estimate is unbiased
  and only drafting noise remains;
- the **time** of one step with that action (Equation 11, extended with the tree-size terms that matter on CPUs:
  ``l1 + l2`` draft forwards over their frontier widths, one target forward over the tree, plus a fixed per-step
  overhead), from a latency model fitted on a microbenchmark of the actual target and drafter (:class:`LatencyModel`);
- the root features of :func:`hf_treespec.policies.nde.root_features` and the target's hidden state at the parent,
  computed exactly as the ``nde`` policy computes them while decoding, plus what the ``paper`` feature set adds: the
  drafter's hidden state at the root and q at the parent (for the p / q divergences), each from one extra draft
  forward over the true context (:func:`draft_probe`).

Why ``num_samples = 8`` by default. Every sample is one delayed tree per trunk length, grown on a shared trie
(:func:`sample_trees`), so one sample costs about ``|trunks| x max_k x max_l2`` draft nodes and as many target tree
rows. The per-root estimate of tau has a drafting standard deviation below about one token, so 8 samples put its
standard error near 0.3 token; the selector is trained on thousands of roots, and since the estimate is unbiased
that noise averages out in the (linear in tau) throughput objective. All actions of a sample share its trunk and
paths (common random numbers): action *differences*, which is what the selector learns, are far less noisy than each
action's value. More samples cost linearly more target rows.

Sharing draws across actions is exact, not an approximation: the trunk of length l1 is the first l1 tokens of the
longest trunk (a prefix of a sampled path is a sampled path) and the k paths of an action are the first k of
``max_k`` i.i.d. paths grown from that trunk node, truncated to l2; every action therefore sees a correctly
distributed tree. Paths are kept in their draw order: the verifiers visit merged i.i.d. children in a uniformly
random order, whose law is the draw order's, so the ordered computation has the verifier's expectation.

Output: a ``datasets`` dataset on disk, written in chunks of prompts (each renamed into place when complete, so a
rerun skips finished chunks), plus ``nde_data.json`` (actions, feature names, verifier, latency model, settings):
:mod:`.nde_dataset` writes and reads it; this module estimates the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList

from hf_treespec.api import (
    comma_list, option, TreeKV, keep_rows, CACHE_KWARG, Drafter, TargetFeatures, capture_hidden_states,
    process_tree_logits, Action, action_space, capture_draft_hidden, root_features, Randomness, DraftTree, laws,
    sliding_layers,
)

from ..evaluation.latency import LatencyModel
from .nde_stats import ActionStats, action_stats
from .nde_trie import ProbsFn, sample_trees, trie_tables

EXTRA_PREFIX = "block_efficiency_"  # column of an extra verifier's block efficiency


def check_verifier(name: str) -> None:
    """Block-efficiency estimates need the verifier's closed-form branching law (`BranchingLaw`)."""
    if name not in laws():
        raise ValueError(
            f"block-efficiency estimates need closed-form branching probabilities; they exist for the top-down "
            f"verifiers {laws()}, not {name!r} (traversal is bottom-up: it has no per-node branching law)."
        )


# ------------------------------------------------------------------------------------------------ per prompt
@dataclass
class NDEDataConfig:
    """What ``generate_nde_data`` estimates. Saved in ``nde_data.json``; a rerun into the same folder must match.

    Args:
        paths / trunks / branches: the action space k x l1 x l2 (:func:`~hf_treespec.policies.nde.action_space`).
        verifier: top-down verifier whose block efficiency is estimated (its `BranchingLaw`).
        extra_verifiers: more verifiers estimated on the same trajectories, tries and target forwards (each adds
            only its branching tables), stored as ``block_efficiency_<name>`` columns; ``load_nde_data(...,
            verifier=name)`` reads one of them as the folder's ``block_efficiency``.
        temperature / top_p / top_k: sampling of the trajectories, of p and q (temperature 0 = greedy, verifier
            must then be ``greedy``).
        max_new_tokens: trajectory length per prompt.
        root_every: a root every this many generated tokens.
        num_samples: delayed trees per root and action (drafting-noise average; see the module docstring).
        trees_per_forward: samples merged into one trie / one target forward (bounds memory).
        chunk_size: prompts per resumable chunk.
        seed: trajectories and tree draws.
    """

    paths: list[int] = field(default_factory=lambda: [1, 2, 4], metadata=option("k values", parse=comma_list(int)))
    trunks: list[int] = field(default_factory=lambda: [0, 1, 2, 3], metadata=option(
        "l1 values", parse=comma_list(int)))
    branches: list[int] = field(default_factory=lambda: [1, 2, 3, 4], metadata=option(
        "l2 values", parse=comma_list(int)))
    verifier: str = field(default="specinfer", metadata=option("set by the command's --verifier", hidden=True))
    extra_verifiers: list[str] = field(default_factory=list, metadata=option(
        "set by the command's --verifier", hidden=True))
    temperature: float = field(default=1.0, metadata=option("0 = greedy (verifier greedy)"))
    top_p: float = field(default=1.0, metadata=option("nucleus sampling of p and q"))
    top_k: int | None = field(default=None, metadata=option("top-k sampling of p and q; default off"))
    max_new_tokens: int = field(default=256, metadata=option("trajectory length per prompt"))
    root_every: int = field(default=16, metadata=option("a root every N generated tokens"))
    num_samples: int = field(default=8, metadata=option("delayed trees per root (drafting-noise average)"))
    trees_per_forward: int = field(default=4, metadata=option("samples merged into one target forward"))
    chunk_size: int = field(default=5, metadata=option("prompts per resumable chunk"))
    seed: int = field(default=0, metadata=option("trajectories and tree draws"))
    target: str = field(default="", metadata=option("recorded", hidden=True))
    drafter: str = field(default="", metadata=option("recorded", hidden=True))

    def __post_init__(self) -> None:
        self.extra_verifiers = [v for v in dict.fromkeys(self.extra_verifiers) if v != self.verifier]
        greedy = self.temperature == 0
        for name in (self.verifier, *self.extra_verifiers):
            check_verifier(name)
            if greedy != (name == "greedy"):
                raise ValueError("temperature 0 (greedy decoding) goes with verifier='greedy', and only then.")
        for name in ("max_new_tokens", "root_every", "num_samples", "trees_per_forward", "chunk_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not 0 < self.top_p <= 1 or self.temperature < 0:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1.")
        self.actions  # noqa: B018  (validates the action space)

    @property
    def actions(self) -> list[Action]:
        return action_space(self.paths, self.trunks, self.branches)

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    def generation_config(self, model) -> GenerationConfig:
        """The generation config of the trajectories (and of the logits processors applied to p and q)."""
        import copy

        config = copy.deepcopy(model.generation_config)
        config.update(do_sample=self.do_sample, num_beams=1, max_new_tokens=self.max_new_tokens)
        if self.do_sample:
            config.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        for key in ("tree_policy", "tree_selector"):
            if hasattr(config, key):
                setattr(config, key, None)
        return config


def logits_processors(model, config: NDEDataConfig, prompt_length: int) -> LogitsProcessorList:
    """The processors ``generate`` would apply with these settings (temperature, top-k, top-p, the model's own)."""
    return model._get_logits_processor(config.generation_config(model), input_ids_seq_length=prompt_length,
                                       device=model.device)


class TargetOracle:
    """Target probabilities at trie nodes: one tree forward per trie over the cached context, logits per chunk."""

    def __init__(self, model, processors: LogitsProcessorList, cache: DynamicCache, committed: int,
                 prefix_ids: torch.Tensor):
        text = model.config.get_text_config()
        transforms = [name for name in ("final_logit_softcapping", "logits_scaling", "logit_scale")
                      if getattr(text, name, None) not in (None, 1, 1.0)]
        if transforms:
            raise ValueError("nde-data computes logits from the decoder's last state with the LM head; models whose "
                             f"logits are transformed after it ({', '.join(transforms)}) are not supported.")
        if sliding_layers(cache):
            raise ValueError(f"nde-data grows tries over the target's cache; {type(model).__name__}'s sliding-window "
                             "layers drop the rows the trie attends to, so sliding-window targets are not supported.")
        self.model, self.processors, self.cache = model, processors, cache
        self.committed, self.prefix_ids = committed, prefix_ids
        self._trie: DraftTree | None = None
        self._hidden: torch.Tensor | None = None

    def _forward(self, trie: DraftTree) -> None:
        device = self.model.device
        kv = TreeKV(self.cache, committed=self.committed)
        ids, positions, mask = kv.inputs_for(trie, torch.arange(trie.num_nodes, device=trie.device), self.model.dtype)
        out = self.model.get_decoder()(input_ids=ids.to(device), position_ids=positions.to(device),
                                       attention_mask=mask.to(device), use_cache=True,
                                       **{CACHE_KWARG: self.cache})
        keep_rows(self.cache, self.committed, torch.zeros(0, dtype=torch.long))
        self._trie, self._hidden = trie, out.last_hidden_state[0]

    def __call__(self, trie: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        if trie is not self._trie:
            self._forward(trie)
        logits = self.model.get_output_embeddings()(self._hidden[nodes.to(self._hidden.device)]).float()
        logits = process_tree_logits(self.processors, self.prefix_ids, trie, nodes, logits)
        return logits.softmax(-1)


def draft_callable(drafter: Drafter, processors: LogitsProcessorList, prefix_ids: torch.Tensor) -> ProbsFn:
    """Warped draft probabilities, exactly as ``WarpedDraftSource`` gives them to the policies."""

    def probs(trie: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        logits = drafter.expand(trie, nodes)
        return torch.log_softmax(process_tree_logits(processors, prefix_ids, trie, nodes, logits), -1).exp()

    return probs


def draft_probe(drafter: Drafter, processors: LogitsProcessorList, sequence: torch.Tensor, position: int,
                states: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q(. | sequence[:position + 1]) warped, the drafter's last-block state there) from a drafter started on the
    true context before ``position`` (``states``: the target features the drafter reads, or None)."""
    drafter.start(sequence[:position], None if states is None else TargetFeatures(states[:position]))
    tree = DraftTree.root(int(sequence[position]))
    node = torch.zeros(1, dtype=torch.long)
    with capture_draft_hidden(drafter) as seen:
        logits = drafter.expand(tree, node)
    prefix = sequence[None, : position + 1]
    q = torch.log_softmax(process_tree_logits(processors, prefix, tree, node, logits.float()), -1).exp()[0]
    return q, seen[-1]


def draft_hidden_size(drafter: Drafter) -> int:
    """Width of the drafter's hidden state (its model's ``hidden_size``)."""
    config = getattr(getattr(drafter, "model", None), "config", None)
    size = getattr(config, "hidden_size", None) if config is not None else None
    if size is None:
        raise ValueError(f"nde-data records the drafter's hidden state; {type(drafter).__name__} has no model config "
                         "with a hidden_size.")
    return int(size)


def estimate_root(
    new_draft: Callable[[], ProbsFn], target: ProbsFn, root_token: int, config: NDEDataConfig,
    generator: Randomness = None, device: torch.device | str = "cpu",
) -> tuple[ActionStats, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample :class:`ActionStats` of one root, q(. | root) and the per-sample tau ``[N, A]`` of each extra
    verifier. ``new_draft()`` restarts the drafter at the root's context (each trie grows from a fresh drafter
    state)."""
    actions = config.actions
    stats, root_q = [], None
    extra: dict[str, list[torch.Tensor]] = {name: [] for name in config.extra_verifiers}
    remaining = config.num_samples
    while remaining > 0:
        count = min(remaining, config.trees_per_forward)
        remaining -= count
        trees = sample_trees(new_draft(), root_token, count, config.trunks, max(config.paths), max(config.branches),
                             generator, device)
        if root_q is None:
            root_q = trees.trie.draft_q(0).float().cpu()
        tables = trie_tables(trees, target, config.verifier, max(config.paths))
        stats.append(action_stats(trees, tables, actions, config.verifier))
        for name in extra:  # the trie's target forward is cached by the oracle: only the tables are new
            extra[name].append(action_stats(trees, trie_tables(trees, target, name, max(config.paths)), actions,
                                            name).tau)
    joined = ActionStats(*(torch.cat([getattr(s, f) for s in stats]) for f in ("tau", "nodes", "draft_width")))
    return joined, root_q, {name: torch.cat(parts) for name, parts in extra.items()}


@torch.no_grad()
def prompt_rows(
    model, drafter: Drafter, prompt_ids: torch.Tensor, config: NDEDataConfig, latency: LatencyModel,
    prompt_index: int = 0,
) -> list[dict[str, Any]]:
    """Trajectory of one prompt (``[1, L]``) and one row per root."""
    device = model.device
    prompt_ids = prompt_ids.to(device)
    torch.manual_seed(config.seed * 1_000_003 + prompt_index)
    sequence = model.generate(prompt_ids, generation_config=config.generation_config(model))[0]
    prompt_length = prompt_ids.shape[1]
    roots = list(range(prompt_length, sequence.numel(), config.root_every))
    if not roots:
        return []
    processors = logits_processors(model, config, prompt_length)
    layers = tuple(drafter.target_layers or ())
    cache = DynamicCache(config=model.config)
    end = roots[-1]
    with capture_hidden_states(model, layers + (-1,)) as states:
        out = model.get_decoder()(input_ids=sequence[None, :end], position_ids=torch.arange(end, device=device)[None],
                                  use_cache=True, **{CACHE_KWARG: cache})
    parent_hidden = states.parts[-1][0]
    drafter_states = states.joined(len(layers))[0] if layers else None
    head = model.get_output_embeddings()
    generator = torch.Generator(device=device).manual_seed(config.seed * 1_000_003 + prompt_index)
    actions = config.actions
    calls = torch.tensor([a.trunk + a.branch for a in actions])
    rows = []
    for t in reversed(roots):
        keep_rows(cache, t, torch.zeros(0, dtype=torch.long))
        prefix = sequence[None, : t + 1]
        parent_logits = head(out.last_hidden_state[0, t - 1 : t]).float()
        p_parent = processors(sequence[None, :t], parent_logits)[0].softmax(-1)

        def new_draft(t=t, prefix=prefix) -> ProbsFn:
            drafter.start(sequence[:t], TargetFeatures(drafter_states[:t]) if layers else None)
            return draft_callable(drafter, processors, prefix)

        target = TargetOracle(model, processors, cache, t, prefix)
        stats, root_q, extra_tau = estimate_root(new_draft, target, int(sequence[t]), config, generator, device)
        _, draft_hidden = draft_probe(drafter, processors, sequence, t, drafter_states)
        parent_q = draft_probe(drafter, processors, sequence, t - 1, drafter_states)[0] if t > 1 else None
        context = t + 1
        nodes, width = stats.nodes.mean(0), stats.draft_width.mean(0)
        seconds = [latency.step_seconds(context, int(c), float(w), float(n)) for c, w, n in zip(calls, width, nodes)]
        features = root_features(p_parent, int(sequence[t]), root_q, context, config.temperature if config.do_sample
                                 else 0.0, config.top_p if config.do_sample else 1.0,
                                 latency.draft_seconds(context, 1), latency.target_seconds(context, 16), parent_q)
        rows.append({
            "prompt": prompt_index, "position": t, "context_length": context, "root_token": int(sequence[t]),
            "target_hidden": parent_hidden[t - 1].float().cpu().tolist(), "scalars": features.tolist(),
            "draft_hidden": draft_hidden.cpu().tolist(),
            "block_efficiency": stats.tau.mean(0).tolist(), "seconds": seconds, "tree_nodes": nodes.tolist(),
            "temperature": config.temperature, "top_p": config.top_p if config.do_sample else 1.0,
            **{f"{EXTRA_PREFIX}{name}": tau.mean(0).tolist() for name, tau in extra_tau.items()},
        })
    return rows[::-1]
