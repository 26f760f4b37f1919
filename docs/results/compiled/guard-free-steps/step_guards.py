"""Inductor's compiled step with dynamo's guards evaluated on every call vs skipped once a graph has compiled
(`CompileSettings.skip_guards`), paired in one process on the same two graphs: SmolLM2-135M-Instruct, bf16, 2 threads,
one row (plain decoding) and five rows (a 4-node tree's verification) at contexts 200 and 1000. Each repeat runs both
settings back to back (order alternating); the medians over 25 steps per run, then the median over repeats, are kept.

python docs/results/compiled/guard-free-steps/step_guards.py > docs/results/compiled/guard-free-steps/step_guards.txt
"""
import dataclasses
import json
import platform
import statistics
import subprocess
import time

import torch
import transformers
from transformers import DynamicCache

import hf_treespec
from hf_treespec.assets import load_target
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
from hf_treespec.compiled import CompileSettings, preallocate
from hf_treespec.compiled.forward import CompiledForward

REPEATS, STEPS = 3, 25
torch.set_num_threads(2)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}})
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# {cpu}; flags {' '.join(flags)}; torch {torch.__version__}; transformers {transformers.__version__}; "
      f"python {platform.python_version()}; commit {commit}", flush=True)
model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
model = hf_treespec.enable(model)
settings = CompileSettings.recommended("cpu")
forward = CompiledForward(model, settings)
print("# compile seconds:", {k: round(v) for k, v in forward.warm_up().items()}, flush=True)


@torch.inference_mode()
def step_ms(rows: int, context: int) -> float:
    cache = DynamicCache(config=model.config)
    preallocate(cache, context + rows * (STEPS + 2) + 8)
    model(input_ids=torch.randint(0, 49152, (1, context)), use_cache=True, **{CACHE_KWARG: cache})
    held, times = context, []
    for _ in range(STEPS):
        ids = torch.randint(0, 49152, (1, rows))
        positions = torch.arange(held, held + rows)[None]
        mask = causal_row_mask(rows, held + rows, torch.bfloat16, "cpu")
        start = time.perf_counter()
        forward(ids, positions, mask, cache)
        times.append(time.perf_counter() - start)
        held += rows
    return 1e3 * statistics.median(times[3:])


rows_out = []
for rows in (1, 5):
    for context in (200, 1000):
        runs = {True: [], False: []}
        for repeat in range(REPEATS):
            for skip in ((True, False) if repeat % 2 == 0 else (False, True)):
                forward.settings = dataclasses.replace(settings, skip_guards=skip)
                runs[skip].append(step_ms(rows, context))
        evaluated, skipped = statistics.median(runs[False]), statistics.median(runs[True])
        row = {"rows": rows, "context": context, "guards_evaluated_ms": round(evaluated, 2),
               "guards_skipped_ms": round(skipped, 2), "ratio": round(evaluated / skipped, 3),
               "runs": {str(k): [round(x, 2) for x in v] for k, v in runs.items()}}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
print("| rows | context | guards evaluated (ms) | guards skipped (ms) | speedup |")
print("|---:|---:|---:|---:|---:|")
for row in rows_out:
    print(f"| {row['rows']} | {row['context']} | {row['guards_evaluated_ms']:.2f} | {row['guards_skipped_ms']:.2f} | "
          f"{row['ratio']:.3f}x |")
