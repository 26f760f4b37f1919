"""Medians of the paired before / after runs in this folder (prints the table README.md and BENCHMARKS.md quote)."""
import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def quick(side: str, method: str, key: str) -> list[float]:
    runs = sorted(HERE.glob(f"quick-{side}-*/summary.json"))
    return [next(m[key] for m in json.loads(p.read_text())["methods"] if m["method"] == method) for p in runs]


def batched(side: str, batch: int, method: str, key: str) -> list[float]:
    runs = sorted(HERE.glob(f"batched-{side}-*/batched.json"))
    return [next(r[key] for r in json.loads(p.read_text())["rows"] if r["batch_size"] == batch and r["method"] == method)
            for p in runs]


def host(pattern: str) -> list[tuple[float, float]]:
    """(host-only ms, wall ms) per step of every run logged in the files matching ``pattern``."""
    out = []
    for p in sorted(HERE.glob(pattern)):
        for m in re.finditer(r"host only ([\d.]+) \| target fwd [\d.]+ \| drafter fwd [\d.]+ \| wall ([\d.]+)",
                             p.read_text()):
            out.append((float(m.group(1)), float(m.group(2))))
    return out


med = statistics.median
print("| measure | before (two loops, threads) | after (one loop, no threads) |")
print("|---|---:|---:|")
for method in ("plain", "tree:salf@tree_budget=16", "tree:salf@tree_budget=auto"):
    b, a = quick("before", method, "tokens_per_s"), quick("after", method, "tokens_per_s")
    print(f"| quick, {method}: tokens/s (median of {len(b)}) | {med(b):.1f} | {med(a):.1f} |")
    if method != "plain":
        b, a = quick("before", method, "speedup"), quick("after", method, "speedup")
        print(f"| quick, {method}: speedup over plain (median) | {med(b):.2f}x | {med(a):.2f}x |")
for batch in (1, 4):
    for method in ("plain", "tree:salf@tree_budget=16"):
        b, a = batched("before", batch, method, "tokens_per_second"), batched("after", batch, method, "tokens_per_second")
        print(f"| batched, batch {batch}, {method}: tokens/s (median of {len(b)}) | {med(b):.1f} | {med(a):.1f} |")
for label, pattern in (("fp32, 1 thread", "host-{}-*.log"), ("bf16, 2 threads", "hostbf16-{}-*.log"),
                       ("bf16, 2 threads, alternating runs", "alternating-{}.log")):
    b, a = host(pattern.format("before")), host(pattern.format("after"))
    print(f"| salf 16 nodes, {label}: host work per step (ms, median of {len(b)} / {len(a)} runs) | "
          f"{med(x for x, _ in b):.2f} | {med(x for x, _ in a):.2f} |")
    print(f"| salf 16 nodes, {label}: wall per step (ms) | {med(w for _, w in b):.1f} | {med(w for _, w in a):.1f} |")
