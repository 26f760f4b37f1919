"""The compiled target step, three ways, in one process (timings interleaved): the previous graph (attention over the
whole buffer, KV heads repeated), lean attention, and lean attention without oneDNN weight prepacking (whose graphs
inductor's FX cache can keep across processes). Median of 9 timed steps per point after one warm-up."""
import json, os, platform, statistics, subprocess, sys, time
import torch
import hf_treespec
from hf_treespec import fast_dtype
from hf_treespec.assets import load_target
from hf_treespec.compiled import CompileSettings, preallocate
import hf_treespec.compiled.forward as F
from hf_treespec.compiled.attention import use_lean_attention
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
from transformers import DynamicCache
torch.set_num_threads(2)
dtype = getattr(torch, os.environ.get("DTYPE", "")) if os.environ.get("DTYPE") else fast_dtype()
only = sys.argv[1:] or ["baseline", "lean", "lean_noprepack"]
OPTS = {"baseline": (("freezing", True), ("max_autotune", True)),
        "lean": (("freezing", True), ("max_autotune", True)),
        "lean_noprepack": (("cpp.weight_prepack", False), ("freezing", True), ("max_autotune", True)),
        # the graph called through inductor's C++ wrapper: no Python between its ~500 kernels
        "lean_cppwrap": (("cpp_wrapper", True), ("freezing", True), ("max_autotune", True))}
variants = {}
for name in only:
    model, tok = load_target("smollm2-135m-instruct", dtype=dtype)
    F.use_lean_attention = (lambda m: False) if name == "baseline" else use_lean_attention
    cf = F.CompiledForward(model, CompileSettings(options=OPTS[name]))
    t = time.perf_counter(); cf.warm_up(1)
    print(name, "compiled in", round(time.perf_counter() - t), "s", {k: round(v) for k, v in cf.compile_seconds.items()}, "lean", cf.lean, flush=True)
    variants[name] = (model, cf, round(time.perf_counter() - t, 1))
gen = torch.Generator().manual_seed(0)
results = {}
with torch.inference_mode():
    for context in (128, 512, 2000):
        caches = {}
        for name, (model, cf, _) in variants.items():
            cache = DynamicCache(config=model.config); preallocate(cache, context + 64)
            model(input_ids=torch.randint(0, 49152, (1, context), generator=gen), use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
            caches[name] = cache
        for rows in (1, 2, 4, 8, 16):
            times = {n: [] for n in variants}
            for rep in range(10):
                for name, (model, cf, _) in variants.items():
                    ids = torch.randint(0, 49152, (1, rows), generator=gen)
                    pos = torch.arange(context, context + rows)[None]
                    mask = causal_row_mask(rows, context + rows, model.dtype, "cpu")
                    t = time.perf_counter(); cf(ids, pos, mask, caches[name]); dt = time.perf_counter() - t
                    caches[name].crop(-rows)
                    if rep: times[name].append(dt)
            for name in variants:
                results[f"{name}/ctx{context}/rows{rows}"] = round(statistics.median(times[name]) * 1000, 2)
            print(f"ctx {context} rows {rows}: " + "  ".join(f"{n} {results[f'{n}/ctx{context}/rows{rows}']:.1f} ms" for n in variants), flush=True)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in open("/proc/cpuinfo").read()]
json.dump({"dtype": str(dtype), "cpu": cpu, "flags": flags, "torch": torch.__version__, "threads": 2,
           "compile_seconds": {n: v[2] for n, v in variants.items()}, "ms": results},
          open(os.environ.get("OUT", "/tmp/ab_step2.json"), "w"), indent=1)
