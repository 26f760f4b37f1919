"""ms per sampled tree node spent in generate's logits warpers: per depth (every processor called once per tree depth,
as before batching) against batched (prefix-independent warpers once over all rows, `process_tree_logits`).

    python examples/warping_cost.py --vocab 49152 --nodes 32 --depth 6 --threads 2

Both paths give identical processed logits (checked here and in tests/test_batched_warping.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from hf_treespec.generation.processors import process_per_depth, process_tree_logits
from hf_treespec.tree import DraftTree

SETTINGS = {
    "temperature 1 + top-p 0.9": lambda: [lp.TemperatureLogitsWarper(1.0), lp.TopPLogitsWarper(0.9)],
    "temperature 0.7 + top-k 50": lambda: [lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(50)],
    "temperature 0.7": lambda: [lp.TemperatureLogitsWarper(0.7)],
    "repetition 1.1 + top-p 0.9": lambda: [lp.RepetitionPenaltyLogitsProcessor(1.1), lp.TopPLogitsWarper(0.9)],
}


def tree_of(nodes: int, depth: int, vocab: int) -> DraftTree:
    """``nodes`` draft nodes spread evenly over ``depth`` levels (each level hangs off the previous level's first)."""
    tree = DraftTree.root(1)
    per_level = max(nodes // depth, 1)
    parent = 0
    for _ in range(depth):
        start = tree.num_nodes
        tree = tree.add_children(torch.full((per_level,), parent), torch.randint(0, vocab, (per_level,)),
                                 torch.full((per_level,), -1.0))
        parent = start
    return tree


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tree = tree_of(args.nodes, args.depth, args.vocab)
    nodes = torch.arange(tree.num_nodes)
    logits = torch.randn(tree.num_nodes, args.vocab) * 3
    prefix = torch.randint(0, args.vocab, (1, 200))
    print(f"{tree.num_nodes} rows, depth {tree.max_depth}, vocab {args.vocab}, {args.threads} threads; ms per node")
    print("| warpers | per depth | batched |\n|---|---:|---:|")
    for name, make in SETTINGS.items():
        processors = LogitsProcessorList(make())
        before = lambda: process_per_depth(processors, prefix, tree, nodes, logits)  # noqa: E731
        after = lambda: process_tree_logits(processors, prefix, tree, nodes, logits)  # noqa: E731
        if not torch.equal(before(), after()):
            raise SystemExit(f"{name}: batched warping differs from per-depth warping")
        ms = [1000 * timed(f, args.repeats) / tree.num_nodes for f in (before, after)]
        print(f"| {name} | {ms[0]:.2f} | {ms[1]:.2f} |")


if __name__ == "__main__":
    main()
