"""Offline training data for the NDE delay selector (delayed-expansion paper, Sections 5-6 and Appendix E).

Pipeline per prompt: the target generates a trajectory (plain ``generate`` with the run's sampling settings); a root
is taken every ``root_every`` tokens of the generated text. For every root and every action (k, l1, l2) we store

- the **block efficiency** of Equation 3: 1 + the expected number of accepted draft tokens of a random (k, l1,
  l2)-delayed tree under the chosen top-down verifier. The inner expectation (verification randomness) is exact: a
  node is reached with the product of the verifier's *branching probabilities* (Definition 5.3) along its path, and
  those are computed in closed form from p and q at each node (:data:`BRANCHING`). The outer expectation (drafting
  randomness) is the mean over ``num_samples`` delayed trees sampled with the drafter, so the estimate is unbiased
  and only drafting noise remains;
- the **time** of one step with that action (Equation 11, extended with the tree-size terms that matter on CPUs:
  ``l1 + l2`` draft forwards over their frontier widths, one target forward over the tree, plus a fixed per-step
  overhead), from a latency model fitted on a microbenchmark of the actual target and drafter (:class:`LatencyModel`);
- the root features of :func:`hf_treespec.policies.nde.root_features` and the target's hidden state at the parent,
  computed exactly as the ``nde`` policy computes them while decoding.

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
rerun skips finished chunks), plus ``nde_data.json`` (actions, feature names, verifier, latency model, settings).
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList

from hf_treespec.cache import TreeKV, keep_rows
from hf_treespec.drafters.base import Drafter, TargetFeatures, as_drafter
from hf_treespec.features import capture_hidden_states
from hf_treespec.generation.processors import process_tree_logits
from hf_treespec.policies.nde import SCALAR_FEATURES, Action, action_space, root_features
from hf_treespec.randomness import RandomSource, Randomness, categorical
from hf_treespec.timing import sync
from hf_treespec.tree import DraftTree, Regime

META_FILE = "nde_data.json"
CHUNK_PREFIX = "chunk-"
#: a draft / target callable: ``(tree, nodes) -> [len(nodes), V]`` warped probabilities
ProbsFn = Callable[[DraftTree, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------------ branching
@dataclass
class NodeTable:
    """What the branching probabilities at one expanded node need, restricted to that node's drafted children.

    ``residuals[j][c]``: p_j(x_c), the target after j SpecInfer rejections (p_0 = p, p_j = norm((p_{j-1} - q)+),
    unchanged when that residual is empty, as in the verifiers); ``draft[c]``: q(x_c); ``argmax``: argmax of p.
    """

    tokens: list[int]
    residuals: list[list[float]]
    draft: list[float]
    argmax: int
    column: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.column = {t: c for c, t in enumerate(self.tokens)}


def _specinfer(table: NodeTable, order: list[int]) -> dict[int, float]:
    """SpecInfer: copy i (in order) is accepted with min(1, p_i(x)/q(x)) after i rejections; else y ~ p_k."""
    out: dict[int, float] = dict.fromkeys(order, 0.0)
    left = 1.0
    for i, c in enumerate(order):
        accept = min(1.0, table.residuals[i][c] / table.draft[c])
        out[c] += left * accept
        left *= 1.0 - accept
    if left > 0:
        final = table.residuals[len(order)]
        for c in out:
            out[c] += left * final[c]
    return out


def _naivetree(table: NodeTable, order: list[int]) -> dict[int, float]:
    """NaiveTree: the first copy with min(1, p/q); else y ~ norm((p - q)+), which may match another child."""
    first = order[0]
    accept = min(1.0, table.residuals[0][first] / table.draft[first])
    out = {c: (1.0 - accept) * table.residuals[1][c] for c in order}
    out[first] += accept
    return out


def _nss(table: NodeTable, order: list[int]) -> dict[int, float]:
    """NSS: y ~ p, so a child is entered with its target probability."""
    return {c: table.residuals[0][c] for c in order}


def _greedy(table: NodeTable, order: list[int]) -> dict[int, float]:
    """T=0: the child equal to argmax p is entered surely."""
    return {c: float(table.tokens[c] == table.argmax) for c in order}


#: verifier name -> (branching probabilities of an ordered child list, residual rows needed at a node whose child
#: lists hold at most ``copies`` draws)
BRANCHING: dict[str, tuple[Callable[[NodeTable, list[int]], dict[int, float]], Callable[[int], int]]] = {
    "specinfer": (_specinfer, lambda copies: copies + 1),
    "naivetree": (_naivetree, lambda copies: 2),
    "nss": (_nss, lambda copies: 1),
    "greedy": (_greedy, lambda copies: 1),
}


def check_verifier(name: str) -> None:
    if name not in BRANCHING:
        raise ValueError(
            f"block-efficiency estimates need closed-form branching probabilities; they exist here for the top-down "
            f"verifiers {sorted(BRANCHING)}, not {name!r} (traversal is bottom-up; spectr / khisti need their "
            "solvers' branching laws, not implemented)."
        )


def node_tables(
    p: torch.Tensor, q: torch.Tensor, children: list[list[int]], depths: Sequence[int]
) -> list[NodeTable]:
    """:class:`NodeTable` of each row (``p``, ``q`` ``[m, V]``; ``children[i]``: that node's distinct child tokens;
    ``depths[i]``: residual rows it needs). The residual chain runs only over the rows that still need it."""
    order = sorted(range(len(children)), key=lambda i: -depths[i])
    rows = torch.tensor(order, device=p.device)
    p, q = p[rows], q[rows]
    width = max(len(c) for c in children)
    index = torch.tensor([children[i] + [0] * (width - len(children[i])) for i in order], device=p.device)
    current = p
    gathered = torch.zeros(len(order), max(depths), width, dtype=p.dtype, device=p.device)
    gathered[:, 0] = p.gather(1, index)
    for j in range(1, max(depths)):
        live = sum(1 for i in order if depths[i] > j)  # a prefix: rows are sorted by depth
        current = current[:live]
        excess = (current - q[:live]).clamp(min=0)
        total = excess.sum(-1, keepdim=True)
        current = torch.where(total > 0, excess / total.clamp(min=torch.finfo(p.dtype).tiny), current)
        gathered[:live, j] = current.gather(1, index[:live])
    residuals, draft, argmax = gathered.tolist(), q.gather(1, index).tolist(), p.argmax(-1).tolist()
    tables: list[NodeTable | None] = [None] * len(order)
    for r, i in enumerate(order):
        c = len(children[i])
        tables[i] = NodeTable(tokens=list(children[i]), residuals=[row[:c] for row in residuals[r][: depths[i]]],
                              draft=draft[r][:c], argmax=argmax[r])
    return tables


# ------------------------------------------------------------------------------------------------ sampling
@dataclass
class SampledTrees:
    """``num_trees`` samples of every delayed tree of the action space, merged into one trie.

    Attributes:
        trie: all sampled paths merged by prefix (node 0 = root); q recorded at every expanded node.
        trunk: ``[N, max_l1 + 1]`` trie node at each trunk depth of sample s (column 0 = the root).
        branches: ``[N, len(trunks), max_k, max_l2 + 1]`` trie nodes of path j grown from the trunk node at depth
            ``trunks[t]`` (column 0 = that node), in draw order.
        trunks: the trunk lengths l1 that have paths.
    """

    trie: DraftTree
    trunk: torch.Tensor
    branches: torch.Tensor
    trunks: list[int]


def _draw(probs: torch.Tensor, inverse: torch.Tensor, generator: Randomness) -> torch.Tensor:
    """One i.i.d. token per slot; slot i draws from ``probs[inverse[i]]`` (slots are distinguishable paths, so their
    order matters). Inverse-CDF sampling on each distinct row (``torch.multinomial`` is far slower on 49k-token rows);
    the generator must live on ``probs``' device."""
    if isinstance(generator, RandomSource):
        return torch.tensor([categorical(probs[int(r)], generator) for r in inverse], dtype=torch.long)
    cdf = probs.float().cumsum(-1)
    sizes = torch.bincount(inverse, minlength=probs.shape[0])
    order = torch.sort(inverse, stable=True).indices
    rank = torch.empty_like(inverse)
    rank[order] = torch.arange(inverse.numel()) - (sizes.cumsum(0) - sizes)[inverse[order]]
    uniform = torch.rand(probs.shape[0], int(sizes.max()), generator=generator, device=probs.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniform, right=True).clamp(max=probs.shape[1] - 1).cpu()
    return tokens[inverse, rank]


def sample_trees(
    draft: ProbsFn, root_token: int, num_trees: int, trunks: Sequence[int], max_paths: int, max_branch: int,
    generator: Randomness = None, device: torch.device | str = "cpu",
) -> SampledTrees:
    """Grows, level by level with one draft call per level, ``num_trees`` trunks of ``max(trunks)`` tokens and from
    each trunk depth in ``trunks`` ``max_paths`` i.i.d. paths of ``max_branch`` tokens, every draw from q."""
    trunks = sorted({int(t) for t in trunks})
    longest, n, t_count, k = max(trunks), num_trees, len(trunks), max_paths
    owners = torch.arange(n).repeat_interleave(t_count * k)
    starts = torch.cat([torch.zeros(n, dtype=torch.long),
                        torch.tensor(trunks).repeat_interleave(k).repeat(n)])
    lengths = torch.cat([torch.full((n,), longest), torch.full((n * t_count * k,), max_branch)])
    path = torch.full((starts.numel(), max(longest, max_branch) + 1), -1, dtype=torch.long)
    path[:n, 0] = 0
    trie = DraftTree.root(root_token, device=device, regime=Regime.IID)
    child_of: dict[tuple[int, int], int] = {}
    expanded, tables = [], []  # q is recorded once at the end (recording per level re-copies the growing table)
    for level in range(longest + max_branch):
        beginning = (starts[n:] == level).nonzero().flatten()
        if beginning.numel():
            path[n + beginning, 0] = path[owners[beginning], level]
        active = ((starts <= level) & (level < starts + lengths)).nonzero().flatten()
        if active.numel() == 0:
            continue
        cols = level - starts[active]
        current = path[active, cols]
        frontier, inverse = current.unique(return_inverse=True)
        probs = draft(trie, frontier.to(device))
        expanded.append(frontier)
        tables.append(probs)
        tokens = _draw(probs, inverse, generator)
        new_parents, new_tokens, children = [], [], []
        for u, x in zip(current.tolist(), tokens.tolist()):
            if (u, x) not in child_of:
                child_of[(u, x)] = trie.num_nodes + len(new_parents)
                new_parents.append(u)
                new_tokens.append(x)
            children.append(child_of[(u, x)])
        if new_parents:
            parents = torch.tensor(new_parents)
            xs = torch.tensor(new_tokens)
            rows = torch.searchsorted(frontier, parents)
            logq = probs[rows.to(probs.device), xs.to(probs.device)].log()
            trie = trie.add_children(parents.to(device), xs.to(device), logq)
        path[active, cols + 1] = torch.tensor(children)
    trie = trie.record_draft_probs(torch.cat(expanded).to(device), torch.cat(tables))
    return SampledTrees(trie=trie, trunk=path[:n, : longest + 1],
                        branches=path[n:, : max_branch + 1].view(n, t_count, k, max_branch + 1), trunks=trunks)


def trie_tables(trees: SampledTrees, target: ProbsFn, verifier: str, max_paths: int,
                chunk: int = 128) -> dict[int, NodeTable]:
    """:class:`NodeTable` of every expanded trie node, target probabilities fetched ``chunk`` nodes at a time."""
    trie = trees.trie
    expanded = (trie.q_index >= 0).nonzero().flatten()
    kids: dict[int, list[int]] = {}
    for u, x in zip(trie.parents.tolist(), trie.tokens.tolist()):
        if u >= 0:
            kids.setdefault(u, []).append(x)
    depth_of = BRANCHING[verifier][1]
    copies = max_copies(trees).tolist()
    tables: dict[int, NodeTable] = {}
    for start in range(0, expanded.numel(), chunk):
        nodes = expanded[start : start + chunk]
        p = target(trie, nodes)
        q = trie.draft_probs[trie.q_index[nodes]].to(p.device, p.dtype)
        ids = nodes.tolist()
        for node, table in zip(ids, node_tables(p, q, [kids[v] for v in ids], [depth_of(copies[v]) for v in ids])):
            tables[node] = table
    return tables


def max_copies(trees: SampledTrees) -> torch.Tensor:
    """``[n]`` the most draws any one action tree makes at each trie node (k paths through a node = k copies in its
    child list; a trunk node has one), which bounds the residual rows its table needs."""
    copies = torch.zeros(trees.trie.num_nodes, dtype=torch.long)
    parents = trees.branches[..., :-1]  # [N, T, K, L2]: the node each draw was made at
    n, t, _, levels = parents.shape
    group = (torch.arange(n * t).view(n, t, 1, 1) * levels + torch.arange(levels)).expand_as(parents)
    pairs, counts = torch.stack([group.flatten(), parents.flatten()], 1).unique(dim=0, return_counts=True)
    copies.scatter_reduce_(0, pairs[:, 1], counts, reduce="amax")
    trunk = trees.trunk[:, :-1].flatten()
    copies[trunk] = copies[trunk].clamp(min=1)
    return copies


@dataclass
class ActionStats:
    """Per-sample statistics of every action: ``tau`` (1 + expected accepted drafts), ``nodes`` (target tree rows,
    root included) and ``draft_width`` (nodes fed to the drafter over the step's ``l1 + l2`` calls). ``[N, A]``."""

    tau: torch.Tensor
    nodes: torch.Tensor
    draft_width: torch.Tensor


def action_stats(trees: SampledTrees, tables: dict[int, NodeTable], actions: Sequence[Action],
                 verifier: str) -> ActionStats:
    """Equation 3 for every sample and action: a node counts with the product of branching probabilities on its path.

    Per sample, the trunk's reach probabilities are computed once, and per (trunk length, k) the branch tree's
    per-depth reach sums once for all l2 (an action's tree is the first k paths truncated to depth l2)."""
    branching = BRANCHING[verifier][0]
    tokens = trees.trie.tokens.tolist()
    n = trees.trunk.shape[0]
    max_branch = trees.branches.shape[-1] - 1
    out = torch.zeros(3, n, len(actions), dtype=torch.float64)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for a, action in enumerate(actions):
        if action.trunk not in trees.trunks or action.paths > trees.branches.shape[2] or action.branch > max_branch:
            raise ValueError(f"action {tuple(action)} is outside the sampled trees (trunks {trees.trunks}, "
                             f"k <= {trees.branches.shape[2]}, l2 <= {max_branch}).")
        by_shape.setdefault((action.trunk, action.paths), []).append(a)

    def enter(parent: int, kids: list[int]) -> dict[int, float]:
        table = tables[parent]
        probs = branching(table, [table.column[tokens[v]] for v in kids])
        return {v: probs[table.column[tokens[v]]] for v in kids}

    for s in range(n):
        trunk = trees.trunk[s].tolist()
        reach, cumulative = [1.0], [0.0]
        for d in range(1, len(trunk)):
            reach.append(reach[-1] * enter(trunk[d - 1], [trunk[d]])[trunk[d]])
            cumulative.append(cumulative[-1] + reach[-1])
        for (l1, k), indices in by_shape.items():
            paths = trees.branches[s, trees.trunks.index(l1), :k].tolist()
            node_reach = {paths[0][0]: 1.0}
            level_sum, level_nodes = [0.0] * (max_branch + 1), [1] + [0] * max_branch
            for d in range(max_branch):
                groups: dict[int, list[int]] = {}
                for path in paths:
                    groups.setdefault(path[d], []).append(path[d + 1])
                for parent, kids in groups.items():
                    for child, prob in enter(parent, kids).items():
                        node_reach[child] = node_reach[parent] * prob
                        level_sum[d + 1] += node_reach[child]
                        level_nodes[d + 1] += 1
            for a in indices:
                l2 = actions[a].branch
                out[0, s, a] = 1.0 + cumulative[l1] + reach[l1] * sum(level_sum[1 : l2 + 1])
                out[1, s, a] = 1 + l1 + sum(level_nodes[1 : l2 + 1])
                out[2, s, a] = l1 + sum(level_nodes[:l2])
    return ActionStats(tau=out[0], nodes=out[1], draft_width=out[2])


# ------------------------------------------------------------------------------------------------ latency
@dataclass
class LatencyModel:
    """Seconds of one forward as ``c0 + c1 n + c2 L + c3 n L`` (n = nodes fed, L = context length / 1000), fitted
    on a microbenchmark for the target (tree forward) and the drafter (one expansion call), plus ``overhead``: per-
    step seconds outside the forwards (verification, bookkeeping). Equation 11 with tree-size terms."""

    target: list[float]
    draft: list[float]
    overhead: float = 0.0
    measurements: dict[str, list[list[float]]] = field(default_factory=dict)

    @staticmethod
    def _design(nodes: float, context: float) -> list[float]:
        c = context / 1000.0
        return [1.0, float(nodes), c, float(nodes) * c]

    def _predict(self, coefficients: list[float], nodes: float, context: float) -> float:
        value = sum(a * b for a, b in zip(coefficients, self._design(nodes, context)))
        return max(value, 1e-6)

    def target_seconds(self, context: int, nodes: float) -> float:
        return self._predict(self.target, nodes, context)

    def draft_seconds(self, context: int, width: float) -> float:
        return self._predict(self.draft, width, context)

    def step_seconds(self, context: int, calls: int, draft_width: float, nodes: float) -> float:
        """``calls`` draft forwards feeding ``draft_width`` nodes in all, one target forward over ``nodes`` rows."""
        c = context / 1000.0
        d0, d1, d2, d3 = self.draft
        draft = calls * (d0 + d2 * c) + draft_width * (d1 + d3 * c)
        return max(draft, 1e-6 * calls) + self.target_seconds(context, nodes) + self.overhead

    @classmethod
    def fit(cls, target: list[tuple[int, int, float]], draft: list[tuple[int, int, float]],
            overhead: float = 0.0) -> "LatencyModel":
        """Least squares on ``(context, nodes, seconds)`` measurements."""

        def solve(samples):
            x = torch.tensor([cls._design(n, c) for c, n, _ in samples], dtype=torch.float64)
            y = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
            return torch.linalg.lstsq(x, y).solution.flatten().tolist()

        return cls(target=solve(target), draft=solve(draft), overhead=overhead,
                   measurements={"target": [list(m) for m in target], "draft": [list(m) for m in draft]})


def _seconds(run: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _star(root: int, tokens: torch.Tensor, device) -> DraftTree:
    tree = DraftTree.root(root, device=device, regime=Regime.IID)
    if tokens.numel():
        tree = tree.add_children(torch.zeros(tokens.numel(), dtype=torch.long, device=device), tokens.to(device),
                                 torch.zeros(tokens.numel(), device=device))
    return tree


@torch.no_grad()
def measure_latency(
    model, drafter_model, contexts: Sequence[int] = (64, 256, 768), target_nodes: Sequence[int] = (1, 8, 24, 48),
    draft_widths: Sequence[int] = (1, 4, 8), repeats: int = 3, overhead: float = 0.0, seed: int = 0,
) -> LatencyModel:
    """Microbenchmark ("warm-up run") of target tree forwards and drafter expansions at several context lengths, on
    random tokens (cost does not depend on the values), fitted by :meth:`LatencyModel.fit`."""
    drafter = as_drafter(drafter_model)
    layers = tuple(drafter.target_layers or ())
    device = model.device
    vocab = int(model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(seed)
    target_samples, draft_samples = [], []
    for context in contexts:
        ids = torch.randint(0, vocab, (context + 1,), generator=generator).to(device)
        cache = DynamicCache(config=model.config)
        with (capture_hidden_states(model, layers) if layers else nullcontext(None)) as states:
            model(input_ids=ids[None, :context], position_ids=torch.arange(context, device=device)[None],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
        features = TargetFeatures(states.hidden_states[0]) if layers else None
        kv = TreeKV(cache, committed=context)
        for nodes in target_nodes:
            tree = _star(int(ids[context]), torch.randint(0, vocab, (nodes - 1,), generator=generator), device)
            inputs, positions, mask = kv.inputs_for(tree, torch.arange(tree.num_nodes, device=device), model.dtype)
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                times.append(_seconds(functools.partial(model, input_ids=inputs, position_ids=positions,
                                                        attention_mask=mask, past_key_values=cache, use_cache=True),
                                      device))
                keep_rows(cache, context, torch.zeros(0, dtype=torch.long))
            target_samples.append((context, nodes, _median(times[1:])))
        for width in draft_widths:
            tokens = torch.randint(0, vocab, (width,), generator=generator)
            times = []
            for _ in range(repeats + 1):
                drafter.start(ids[:context], features)
                root = _star(int(ids[context]), torch.zeros(0, dtype=torch.long), device)
                drafter.expand(root, torch.zeros(1, dtype=torch.long, device=device))  # feeds the prefix too
                tree = root.add_children(torch.zeros(width, dtype=torch.long, device=device), tokens.to(device),
                                         torch.zeros(width, device=device))
                times.append(_seconds(functools.partial(drafter.expand, tree, torch.arange(1, width + 1, device=device)),
                                      device))
            draft_samples.append((context, width, _median(times[1:])))
    return LatencyModel.fit(target_samples, draft_samples, overhead)


# ------------------------------------------------------------------------------------------------ per prompt
@dataclass
class NDEDataConfig:
    """What ``generate_nde_data`` estimates. Saved in ``nde_data.json``; a rerun into the same folder must match.

    Args:
        paths / trunks / branches: the action space k x l1 x l2 (:func:`~hf_treespec.policies.nde.action_space`).
        verifier: top-down verifier whose block efficiency is estimated (:data:`BRANCHING`).
        temperature / top_p / top_k: sampling of the trajectories, of p and q (temperature 0 = greedy, verifier
            must then be ``greedy``).
        max_new_tokens: trajectory length per prompt.
        root_every: a root every this many generated tokens.
        num_samples: delayed trees per root and action (drafting-noise average; see the module docstring).
        trees_per_forward: samples merged into one trie / one target forward (bounds memory).
        chunk_size: prompts per resumable chunk.
        seed: trajectories and tree draws.
    """

    paths: list[int] = field(default_factory=lambda: [1, 2, 4])
    trunks: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    branches: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    verifier: str = "specinfer"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 256
    root_every: int = 16
    num_samples: int = 8
    trees_per_forward: int = 4
    chunk_size: int = 5
    seed: int = 0
    target: str = ""
    drafter: str = ""

    def __post_init__(self) -> None:
        check_verifier(self.verifier)
        greedy = self.temperature == 0
        if greedy != (self.verifier == "greedy"):
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
        softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        if softcap:
            raise ValueError("nde-data computes logits from the decoder's last state with the LM head; models with "
                             "final logit soft-capping are not supported.")
        self.model, self.processors, self.cache = model, processors, cache
        self.committed, self.prefix_ids = committed, prefix_ids
        self._trie: DraftTree | None = None
        self._hidden: torch.Tensor | None = None

    def _forward(self, trie: DraftTree) -> None:
        device = self.model.device
        kv = TreeKV(self.cache, committed=self.committed)
        ids, positions, mask = kv.inputs_for(trie, torch.arange(trie.num_nodes, device=trie.device), self.model.dtype)
        out = self.model.get_decoder()(input_ids=ids.to(device), position_ids=positions.to(device),
                                       attention_mask=mask.to(device), past_key_values=self.cache, use_cache=True)
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


def estimate_root(
    new_draft: Callable[[], ProbsFn], target: ProbsFn, root_token: int, config: NDEDataConfig,
    generator: Randomness = None, device: torch.device | str = "cpu",
) -> tuple[ActionStats, torch.Tensor]:
    """Per-sample :class:`ActionStats` of one root and q(. | root). ``new_draft()`` restarts the drafter at the root's
    context (each trie grows from a fresh drafter state)."""
    actions = config.actions
    stats, root_q = [], None
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
    return ActionStats(*(torch.cat([getattr(s, f) for s in stats]) for f in ("tau", "nodes", "draft_width"))), root_q


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
                                  past_key_values=cache, use_cache=True)
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
        stats, root_q = estimate_root(new_draft, target, int(sequence[t]), config, generator, device)
        context = t + 1
        nodes, width = stats.nodes.mean(0), stats.draft_width.mean(0)
        seconds = [latency.step_seconds(context, int(c), float(w), float(n)) for c, w, n in zip(calls, width, nodes)]
        features = root_features(p_parent, int(sequence[t]), root_q, context, config.temperature if config.do_sample
                                 else 0.0, config.top_p if config.do_sample else 1.0,
                                 latency.draft_seconds(context, 1), latency.target_seconds(context, 16))
        rows.append({
            "prompt": prompt_index, "position": t, "context_length": context, "root_token": int(sequence[t]),
            "target_hidden": parent_hidden[t - 1].float().cpu().tolist(), "scalars": features.tolist(),
            "block_efficiency": stats.tau.mean(0).tolist(), "seconds": seconds, "tree_nodes": nodes.tolist(),
            "temperature": config.temperature, "top_p": config.top_p if config.do_sample else 1.0,
        })
    return rows[::-1]


# ------------------------------------------------------------------------------------------------ dataset
def _features(hidden_size: int, num_actions: int):
    from datasets import Features, Sequence as Seq, Value

    return Features({
        "prompt": Value("int32"), "position": Value("int32"), "context_length": Value("int32"),
        "root_token": Value("int32"), "target_hidden": Seq(Value("float32"), length=hidden_size),
        "scalars": Seq(Value("float32"), length=len(SCALAR_FEATURES)),
        "block_efficiency": Seq(Value("float32"), length=num_actions),
        "seconds": Seq(Value("float32"), length=num_actions), "tree_nodes": Seq(Value("float32"), length=num_actions),
        "temperature": Value("float32"), "top_p": Value("float32"),
    })


def _meta(config: NDEDataConfig, hidden_size: int, latency: LatencyModel) -> dict[str, Any]:
    return {"actions": [list(a) for a in config.actions], "scalar_features": list(SCALAR_FEATURES),
            "hidden_size": hidden_size, "verifier": config.verifier, "latency": asdict(latency),
            "config": asdict(config)}


def generate_nde_data(
    model, drafter_model, prompts: Sequence[torch.Tensor], output: str | Path, config: NDEDataConfig,
    latency: LatencyModel | None = None, progress: bool = True,
) -> Path:
    """Writes the NDE training data of ``prompts`` (``[1, L]`` token tensors) to ``output`` (resumable).

    ``latency``: the timing model of Equation 11; measured with :func:`measure_latency` when None (and reused from
    ``nde_data.json`` when resuming, so every chunk shares one timing model).
    """
    from datasets import Dataset

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    drafter = as_drafter(drafter_model)
    vocab = int(model.config.get_text_config().vocab_size)
    if drafter.vocab_size != vocab:
        raise ValueError(f"the drafter's vocabulary ({drafter.vocab_size}) differs from the target's ({vocab}).")
    hidden_size = int(model.config.get_text_config().hidden_size)
    meta_path = output / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta["config"] != asdict(config) or meta["hidden_size"] != hidden_size:
            raise ValueError(f"{output} holds NDE data made with other settings ({meta['config']}); use another "
                             "--output or the same settings to resume.")
        latency = LatencyModel(**meta["latency"])
    else:
        latency = latency or measure_latency(model, drafter_model)
        meta_path.write_text(json.dumps(_meta(config, hidden_size, latency), indent=2) + "\n")
    features = _features(hidden_size, len(config.actions))
    bar = tqdm(total=len(prompts), desc="nde-data", unit="prompt", disable=not progress)
    roots = 0
    for chunk, start in enumerate(range(0, len(prompts), config.chunk_size)):
        folder = output / f"{CHUNK_PREFIX}{chunk:05d}"
        batch = prompts[start : start + config.chunk_size]
        if folder.is_dir():
            bar.update(len(batch))
            continue
        rows = []
        for offset, prompt in enumerate(batch):
            rows += prompt_rows(model, drafter, prompt, config, latency, start + offset)
            bar.update(1)
            bar.set_postfix(roots=roots + len(rows))
        roots += len(rows)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        columns = {name: [row[name] for row in rows] for name in features}
        Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
        tmp.rename(folder)
    bar.close()
    return output


@dataclass
class NDEData:
    """The rows of one or more ``nde-data`` folders and their shared metadata."""

    dataset: Any
    meta: dict[str, Any]

    @property
    def actions(self) -> list[Action]:
        return [Action(*a) for a in self.meta["actions"]]

    def __len__(self) -> int:
        return len(self.dataset)


def load_nde_data(paths: str | Path | Iterable[str | Path]) -> NDEData:
    """Concatenates the finished chunks of one or more folders (e.g. several temperatures); their actions, features,
    verifier and target hidden size must agree."""
    from datasets import concatenate_datasets, load_from_disk

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    parts, meta = [], None
    for path in map(Path, paths):
        if not (path / META_FILE).is_file():
            raise ValueError(f"{path} is not an nde-data folder (no {META_FILE}); make one with "
                             "`hf-treespec train nde-data`.")
        this = json.loads((path / META_FILE).read_text())
        if meta is not None:
            for key in ("actions", "scalar_features", "hidden_size", "verifier"):
                if this[key] != meta[key]:
                    raise ValueError(f"{path} has other {key} than {paths[0]}; NDE data folders must share it.")
        meta = meta or this
        parts += [load_from_disk(str(p)) for p in sorted(path.glob(f"{CHUNK_PREFIX}*"))
                  if p.is_dir() and not p.name.endswith(".tmp")]
    if not parts:
        raise ValueError(f"no finished chunk in {', '.join(map(str, paths))}.")
    return NDEData(dataset=concatenate_datasets(parts) if len(parts) > 1 else parts[0], meta=meta)
