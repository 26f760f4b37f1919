"""Latency model of one speculative step (Equation 11 of the delayed-expansion paper with tree-size terms), fitted on
a microbenchmark of the actual target and drafter."""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from hf_treespec.api import (
    TreeKV, keep_rows, CACHE_KWARG, TargetFeatures, as_drafter, capture_hidden_states, sync, DraftTree, Regime,
)


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
                  use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
        features = TargetFeatures(states.hidden_states[0]) if layers else None
        kv = TreeKV(cache, committed=context)
        for nodes in target_nodes:
            tree = _star(int(ids[context]), torch.randint(0, vocab, (nodes - 1,), generator=generator), device)
            inputs, positions, mask = kv.inputs_for(tree, torch.arange(tree.num_nodes, device=device), model.dtype)
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                times.append(_seconds(functools.partial(model, input_ids=inputs, position_ids=positions,
                                                        attention_mask=mask, use_cache=True,
                                                        **{CACHE_KWARG: cache}),
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
