"""Inductor's compiled step with the few-rows bf16 linear (`hf_treespec/compiled/few_rows_linear.py`) against the
same step with inductor's own linears, paired in one process: two copies of SmolLM2-135M-Instruct, bf16, 2 threads,
each compiled with the recommended settings (one with ``few_rows_linear=False``); 1-16 rows at contexts 200 and 1000;
each repeat times both back to back (order alternating), 25 steps a run (median), 3 repeats (median). Also the
model's 211 linears alone (packed op against eager ``F.linear``), the two steps' logits and the compiled prefill of
20-, 50- and 400-token prompts (past `MOST_ROWS` rows the op hands over to ``at::linear``).

python docs/results/compiled/few-rows-linear/step_linear.py > docs/results/compiled/few-rows-linear/step_linear.txt
"""
import json
import statistics
import subprocess
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache

import hf_treespec
from hf_treespec.assets import load_target
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
from hf_treespec.compiled import CompileSettings, preallocate
from hf_treespec.compiled.few_rows_linear import load_few_rows_linear
from hf_treespec.compiled.forward import CompiledForward

REPEATS, STEPS = 3, 25
ROWS, CONTEXTS = (1, 2, 3, 5, 8, 12, 16), (200, 1000)
PROMPTS = (20, 50, 400)
torch.set_num_threads(2)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}})
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# {cpu}; flags {' '.join(flags)}; torch {torch.__version__}; transformers {transformers.__version__}; "
      f"commit {commit}", flush=True)


def median_seconds(call, reps=15):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# the linears alone: every weight of the model through eager F.linear and through the op, in model order
op = load_few_rows_linear()
model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
packed = [torch.ops.hf_treespec.few_rows_pack(m.weight.detach()) for m in linears]
with torch.inference_mode():
    for rows in ROWS:
        x = {m.in_features: torch.randn(1, rows, m.in_features, dtype=torch.bfloat16) for m in linears}
        eager = median_seconds(lambda: [F.linear(x[m.in_features], m.weight) for m in linears])
        ours = median_seconds(lambda: [op(x[m.in_features], m.weight, p, None) for m, p in zip(linears, packed)])
        print(json.dumps({"linears": len(linears), "rows": rows, "eager_f_linear_ms": round(1e3 * eager, 2),
                          "few_rows_op_ms": round(1e3 * ours, 2)}), flush=True)
del model, linears, packed

forwards = {}
for name in ("few-rows op", "inductor's linears"):
    model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    model = hf_treespec.enable(model)
    settings = replace(CompileSettings.recommended("cpu"), few_rows_linear=name == "few-rows op")
    forwards[name] = CompiledForward(model, settings)
    seconds = forwards[name].warm_up()
    print(f"# {name}: routed linears {0 if forwards[name].linears is None else len(forwards[name].linears.handles)}, "
          f"compile seconds {seconds}", flush=True)


@torch.inference_mode()
def step_ms(name: str, context: int, rows: int) -> tuple[float, torch.Tensor]:
    forward = forwards[name]
    model = forward.model
    torch.manual_seed(context)
    cache = DynamicCache(config=model.config)
    preallocate(cache, context + rows + 8)
    model(input_ids=torch.randint(0, 49152, (1, context)), use_cache=True, **{CACHE_KWARG: cache})
    mask = causal_row_mask(rows, context + rows, torch.bfloat16, "cpu")
    ids, positions = torch.randint(0, 49152, (1, rows)), torch.arange(context, context + rows)[None]
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        logits = forward(ids, positions, mask, cache)
        times.append(time.perf_counter() - start)
        for layer in cache.layers:
            layer.view_rows(context)
    return 1e3 * statistics.median(times[3:]), logits.float()


results = []
for context in CONTEXTS:
    for rows in ROWS:
        runs = {name: [] for name in forwards}
        for repeat in range(REPEATS):
            order = list(forwards) if repeat % 2 == 0 else list(forwards)[::-1]
            last = {}
            for name in order:
                ms, last[name] = step_ms(name, context, rows)
                runs[name].append(ms)
        ours, theirs = (statistics.median(runs[name]) for name in forwards)
        gap = (last["few-rows op"] - last["inductor's linears"]).abs().max().item()
        same = bool((last["few-rows op"].argmax(-1) == last["inductor's linears"].argmax(-1)).all())
        row = {"context": context, "rows": rows, "inductor_linears_ms": round(theirs, 2),
               "few_rows_op_ms": round(ours, 2), "speedup": round(theirs / ours, 3),
               "logits_max_abs_diff": round(gap, 4), "same_argmax": same,
               "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
        results.append(row)
        print(json.dumps(row), flush=True)


@torch.inference_mode()
def prefill_ms(name: str, length: int) -> float:
    forward = forwards[name]
    ids = torch.randint(0, 49152, (1, length), generator=torch.Generator().manual_seed(length))
    times = []
    for _ in range(5):
        cache = DynamicCache(config=forward.model.config)
        preallocate(cache, length + 8)
        start = time.perf_counter()
        assert forward.prefill(ids, torch.arange(length)[None], None, cache, ()) is not None
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


for length in PROMPTS:
    runs = {name: [] for name in forwards}
    for repeat in range(REPEATS):
        for name in (list(forwards) if repeat % 2 == 0 else list(forwards)[::-1]):
            runs[name].append(prefill_ms(name, length))
    print(json.dumps({"prefill_tokens": length, **{f"{k} ms": round(statistics.median(v), 1) for k, v in runs.items()},
                      "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()}}), flush=True)
print("| context | rows | inductor's linears (ms) | few-rows op (ms) | speedup |")
print("|---:|---:|---:|---:|---:|")
for row in results:
    print(f"| {row['context']} | {row['rows']} | {row['inductor_linears_ms']:.2f} | {row['few_rows_op_ms']:.2f} | "
          f"{row['speedup']:.3f}x |")
