"""The prompt forward of a compiled run, paired: eager (what a compiled run did before) against the compiled graphs
(`CompiledForward.prefill`, held rows 0, chunks of PREFILL_CHUNK rows), SmolLM2-135M bf16, random prompts of n tokens,
median of 5; the first compiled call of each length runs under the stance that fails on any recompile."""
import time, statistics, sys
import torch
from transformers import DynamicCache
import hf_treespec
from hf_treespec.assets import load_target
from hf_treespec.compiled import CompileSettings, preallocate
from hf_treespec.compiled.forward import compiled_forward_for
torch.set_num_threads(2)
model, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
model = hf_treespec.enable(model)
cf = compiled_forward_for(model, CompileSettings.recommended("cpu"))
cf.warm_up(1)
def fresh(n):
    cache = DynamicCache(config=model.config); preallocate(cache, n + 200)
    return cache
def eager(ids):
    cache = fresh(ids.shape[1])
    return model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=True, past_key_values=cache, logits_to_keep=1).logits
def compiled(ids, stance=None):
    n = ids.shape[1]; cache = fresh(n)
    if stance:
        with torch.compiler.set_stance("fail_on_recompile"):
            return cf.prefill(ids, torch.arange(n)[None], None, cache, ())[0]
    return cf.prefill(ids, torch.arange(n)[None], None, cache, ())[0]
with torch.inference_mode():
    for n in (20, 50, 150, 400):
        ids = torch.randint(0, 49152, (1, n))
        a = eager(ids); b = compiled(ids, stance=True)
        print(n, "last row's argmax equal", bool((a[0, -1].argmax() == b[0, -1].argmax())), "max diff", (a[0, -1].float() - b[0, -1].float()).abs().max().item(), flush=True)
        te, tc = [], []
        for _ in range(5):
            s = time.perf_counter(); eager(ids); te.append(time.perf_counter() - s)
            s = time.perf_counter(); compiled(ids); tc.append(time.perf_counter() - s)
        print(n, f"eager {statistics.median(te)*1e3:.1f} ms, compiled {statistics.median(tc)*1e3:.1f} ms", flush=True)
