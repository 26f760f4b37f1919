"""Where inductor's one-row step spends its time (torch profiler, 5 steps after 3 warm ones; SmolLM2-135M-Instruct,
bf16, 2 threads): at context 200 with dynamo's guards evaluated and skipped (`CompileSettings.skip_guards`), and at
context 2000 (guards skipped), to see what the attention costs.

python docs/results/compiled/guard-free-steps/step_profile.py > docs/results/compiled/guard-free-steps/step_profile.txt
"""
import dataclasses
import subprocess

import torch
from transformers import DynamicCache

import hf_treespec
from hf_treespec.assets import load_target
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
from hf_treespec.compiled import CompileSettings, preallocate
from hf_treespec.compiled.forward import CompiledForward

torch.set_num_threads(2)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# {cpu}; torch {torch.__version__}; commit {commit}", flush=True)
model, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
model = hf_treespec.enable(model)
settings = CompileSettings.recommended("cpu")
forward = CompiledForward(model, settings)
forward.warm_up(rows=(1,))


@torch.inference_mode()
def profile(context: int, skip: bool) -> None:
    forward.settings = dataclasses.replace(settings, skip_guards=skip)
    cache = DynamicCache(config=model.config)
    preallocate(cache, context + 16)
    model(input_ids=torch.randint(0, 49152, (1, context)), use_cache=True, **{CACHE_KWARG: cache})
    held = context

    def step():
        nonlocal held
        mask = causal_row_mask(1, held + 1, torch.bfloat16, "cpu")
        forward(torch.randint(0, 49152, (1, 1)), torch.tensor([[held]]), mask, cache)
        held += 1

    for _ in range(3):
        step()
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(5):
            step()
    print(f"\n## context {context}, guards {'skipped' if skip else 'evaluated'} (5 steps)\n", flush=True)
    print(prof.key_averages(group_by_input_shape=context > 1000).table(
        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40, max_shapes_column_width=60))


profile(200, skip=False)
profile(200, skip=True)
profile(2000, skip=True)
