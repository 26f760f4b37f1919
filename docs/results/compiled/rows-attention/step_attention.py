"""Inductor's few-rows step (a tree's verification, batch of one, 2-16 rows) with its attention through the
in-place op (`hf_treespec/compiled/cache_attention.py`: query vectors across vector lanes, keys and values read
in place) against the same step attending with two ``bmm`` per layer (`grouped_attention`, what several rows ran
before), paired in one process: two copies of SmolLM2-135M-Instruct, bf16, 2 threads, each compiled with the
recommended settings (the few-rows graph only); 2-16 rows at contexts 200 and 1000; each repeat times both back to
back (order alternating), 25 steps a run (median), 3 repeats (median). Also the attention of one layer alone.

python docs/results/compiled/rows-attention/step_attention.py > docs/results/compiled/rows-attention/step_attention.txt
"""
import json
import statistics
import subprocess
import time

import torch
import transformers
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hf_treespec
from hf_treespec.assets import load_target
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
from hf_treespec.compiled import CompileSettings, preallocate
from hf_treespec.compiled.attention import BASES, PREFIX, _lean, grouped_attention
from hf_treespec.compiled.cache_attention import load_cache_attention
from hf_treespec.compiled.forward import CompiledForward

REPEATS, STEPS = 3, 25
ROWS, CONTEXTS = (2, 3, 5, 8, 12, 16), (200, 1000)
torch.set_num_threads(2)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}})
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# {cpu}; flags {' '.join(flags)}; torch {torch.__version__}; transformers {transformers.__version__}; "
      f"commit {commit}", flush=True)
op = load_cache_attention()


def median_seconds(call, reps=50):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


# one layer's attention alone (9 query heads, 3 KV heads of 64, buffers 64 rows past the context)
with torch.inference_mode():
    for context in CONTEXTS:
        for rows in (1, *ROWS):
            query = torch.randn(1, rows, 9, 64).to(torch.bfloat16).transpose(1, 2)
            key, value = (torch.randn(1, 3, context + 64, 64).to(torch.bfloat16) for _ in range(2))
            mask = causal_row_mask(rows, context, torch.bfloat16, "cpu")
            ours = median_seconds(lambda: op(query, key, value, mask, 0.125))
            theirs = median_seconds(lambda: grouped_attention(query, key, value, mask, 0.125))
            print(json.dumps({"layer_attention": True, "context": context, "rows": rows, "op_us": round(1e6 * ours, 1),
                              "eager_bmm_us": round(1e6 * theirs, 1)}), flush=True)


def bmm_rows(query, key, value, mask, scale):
    """What several rows ran before: the op for one row, two bmm for more."""
    return op(query, key, value, mask, scale) if query.shape[2] == 1 else grouped_attention(query, key, value, mask, scale)


AttentionInterface.register(PREFIX + "bmm_rows_sdpa", _lean(BASES["sdpa"], in_place=bmm_rows))
AttentionMaskInterface.register(PREFIX + "bmm_rows_sdpa", sdpa_mask)
forwards = {}
for name in ("in-place op", "bmm"):
    model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    model = hf_treespec.enable(model)
    if name == "bmm":
        model.set_attn_implementation(PREFIX + "bmm_rows_sdpa")
    forwards[name] = CompiledForward(model, CompileSettings.recommended("cpu"))
    seconds = forwards[name].warm_up(rows=(8,))
    print(f"# {name}: attention {model.config._attn_implementation}, compile seconds {seconds}", flush=True)


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
        gap = (last["in-place op"] - last["bmm"]).abs().max().item()
        same = bool((last["in-place op"].argmax(-1) == last["bmm"].argmax(-1)).all())
        row = {"context": context, "rows": rows, "bmm_ms": round(theirs, 2), "in_place_op_ms": round(ours, 2),
               "speedup": round(theirs / ours, 3), "logits_max_abs_diff": round(gap, 4), "same_argmax": same,
               "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
        results.append(row)
        print(json.dumps(row), flush=True)
print("| context | rows | bmm (ms) | in-place op (ms) | speedup |")
print("|---:|---:|---:|---:|---:|")
for row in results:
    print(f"| {row['context']} | {row['rows']} | {row['bmm_ms']:.2f} | {row['in_place_op_ms']:.2f} | {row['speedup']:.3f}x |")
