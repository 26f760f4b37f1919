"""What a change of row count between steps costs the OpenVINO step: steps of one row count, then of two or three
alternating (one prompt of 256 tokens each, rows held as rejected tree rows are; ms, median of the steps of each
row count after the first two). Run: ``python docs/results/compiled/openvino-step/shapes.py`` (bf16, 2 threads)."""
import statistics
import subprocess
import time

import torch
from hf_treespec.assets import load_target
from hf_treespec.attention import additive_mask, causal_row_mask
from hf_treespec.compiled.openvino_step import OpenVINOStep
torch.set_num_threads(2)
model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
step = OpenVINOStep(model, None, (1, 14, 26))
def run(pattern, n=40, context=256):
    step.reset()
    prompt = torch.randint(0, 49152, (1, context), generator=g)
    step(prompt, torch.arange(context)[None], causal_row_mask(context, context, torch.float32, "cpu"), last_only=True)
    times = {}
    for i in range(n):
        rows = pattern[i % len(pattern)]
        visible = torch.zeros(rows, step.held + rows, dtype=torch.bool)
        visible[:, :context] = True
        visible[:, step.held:] = torch.ones(rows, rows, dtype=torch.bool).tril()
        ids = torch.randint(0, 49152, (1, rows), generator=g)
        s = time.perf_counter()
        step(ids, torch.arange(context, context + rows)[None], additive_mask(visible, torch.float32)[None, None])
        times.setdefault(rows, []).append(time.perf_counter() - s)
    return {r: round(1e3 * statistics.median(t[2:]), 2) for r, t in times.items()}
print(subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip(),
      torch.__version__, "commit", subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                  text=True).stdout.strip())
for pattern in ([1], [5], [1, 5], [5], [1], [3, 5], [3], [5, 9], [9], [1, 1, 5], [1]):
    print(pattern, run(pattern), flush=True)
