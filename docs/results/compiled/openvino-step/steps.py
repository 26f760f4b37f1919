"""The OpenVINO target step on its own: the time of one step by rows (1-16) and context (128-1024), with and without
the drafter's three captured layers, and how long a new process takes to be ready from the cached IR.

Run: ``python docs/results/compiled/openvino-step/steps.py [out.json]`` (bf16, 2 threads). Each step's rows stay
held after it is timed (as rejected tree rows do in decoding), masked out of the next.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_treespec.assets import load_target
from hf_treespec.attention import additive_mask, causal_row_mask
from hf_treespec.compiled.openvino_step import OpenVINOStep

READY = """
import time, torch
start = time.perf_counter()
from hf_treespec.assets import load_target
from hf_treespec.compiled.openvino_step import OpenVINOStep
model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
loaded = time.perf_counter()
step = OpenVINOStep(model, None, (1, 14, 26))
print(step.failure, "export" in step.compile_seconds, loaded - start, time.perf_counter() - loaded)
"""


def main() -> None:
    torch.set_num_threads(2)
    model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    report: dict = {"ms": {}}
    generator = torch.Generator().manual_seed(0)
    for layers in ((), (1, 14, 26)):
        step = OpenVINOStep(model, None, layers)
        for context in (128, 512, 1024):
            step.reset()
            prompt = torch.randint(0, 49152, (1, context), generator=generator)
            step(prompt, torch.arange(context)[None], causal_row_mask(context, context, torch.float32, "cpu"),
                 last_only=True)
            for rows in (1, 2, 4, 8, 16):
                times = []
                for _ in range(12):
                    visible = torch.zeros(rows, step.held + rows, dtype=torch.bool)
                    visible[:, :context] = True
                    visible[:, step.held:] = torch.ones(rows, rows, dtype=torch.bool).tril()
                    ids = torch.randint(0, 49152, (1, rows), generator=generator)
                    start = time.perf_counter()
                    step(ids, torch.arange(context, context + rows)[None], additive_mask(visible, torch.float32)[None, None])
                    times.append(time.perf_counter() - start)
                key = f"layers {list(layers)}, context {context}, rows {rows}"
                report["ms"][key] = round(1e3 * statistics.median(times[2:]), 2)
                print(key, report["ms"][key], "ms", flush=True)
    done = subprocess.run([sys.executable, "-c", READY], capture_output=True, text=True, check=True)
    failure, exported, load_s, ready_s = done.stdout.split()[-4:]
    report["second process"] = {"failure": failure, "exported again": exported == "True",
                                "model load s": round(float(load_s), 2), "step ready after load s": round(float(ready_s), 2)}
    print(report["second process"])
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("steps.json")
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
