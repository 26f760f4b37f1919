"""Inductor's one-row step with the one-row cache attention (the C++ op reading the KV buffers in place) against the
bmm stand-in, paired in one process: two copies of SmolLM2-135M-Instruct, bf16, 2 threads, each compiled with the
recommended settings; contexts 200, 1000 and 2000; each repeat times both back to back (order alternating), 25
steps a run (median), 3 repeats (median). Also checks the two steps' logits agree.

python docs/results/compiled/cache-attention/step_attention.py > docs/results/compiled/cache-attention/step_attention.txt
"""
import json
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
from hf_treespec.compiled.attention import PREFIX
from hf_treespec.compiled.forward import CompiledForward

REPEATS, STEPS = 3, 25
torch.set_num_threads(2)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}})
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# {cpu}; flags {' '.join(flags)}; torch {torch.__version__}; transformers {transformers.__version__}; "
      f"commit {commit}", flush=True)
forwards = {}
for name in ("in place", "bmm"):
    model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    model = hf_treespec.enable(model)
    if name == "bmm":
        model.set_attn_implementation(PREFIX + "sdpa")  # the lean stand-in without the op
    forwards[name] = CompiledForward(model, CompileSettings.recommended("cpu"))
    seconds = forwards[name].warm_up(rows=(1,))
    print(f"# {name}: attention {model.config._attn_implementation}, compile seconds {seconds}", flush=True)


@torch.inference_mode()
def step_ms(name: str, context: int) -> tuple[float, torch.Tensor]:
    forward = forwards[name]
    model = forward.model
    torch.manual_seed(context)
    cache = DynamicCache(config=model.config)
    preallocate(cache, context + STEPS + 8)
    model(input_ids=torch.randint(0, 49152, (1, context)), use_cache=True, **{CACHE_KWARG: cache})
    held, times = context, []
    for _ in range(STEPS):
        mask = causal_row_mask(1, held + 1, torch.bfloat16, "cpu")
        start = time.perf_counter()
        logits = forward(torch.randint(0, 49152, (1, 1)), torch.tensor([[held]]), mask, cache)
        times.append(time.perf_counter() - start)
        held += 1
    return 1e3 * statistics.median(times[3:]), logits.float()


rows = []
for context in (200, 1000, 2000):
    runs = {"in place": [], "bmm": []}
    for repeat in range(REPEATS):
        order = ("in place", "bmm") if repeat % 2 == 0 else ("bmm", "in place")
        last = {}
        for name in order:
            ms, last[name] = step_ms(name, context)
            runs[name].append(ms)
    gap = (last["in place"] - last["bmm"]).abs().max().item()
    same = bool(last["in place"].argmax() == last["bmm"].argmax())
    row = {"context": context, "bmm_ms": round(statistics.median(runs["bmm"]), 2),
           "in_place_ms": round(statistics.median(runs["in place"]), 2),
           "speedup": round(statistics.median(runs["bmm"]) / statistics.median(runs["in place"]), 3),
           "last_logits_max_abs_diff": round(gap, 4), "same_argmax": same,
           "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
    rows.append(row)
    print(json.dumps(row), flush=True)
print("| context | bmm (ms) | in place (ms) | speedup |")
print("|---:|---:|---:|---:|")
for row in rows:
    print(f"| {row['context']} | {row['bmm_ms']:.2f} | {row['in_place_ms']:.2f} | {row['speedup']:.3f}x |")
