"""Host milliseconds per tree step with sampling's warpers run over the drafter's reduced vocabulary alone (this
folder's code) or over the whole vocabulary (the draft source told that no processor is column-local: a
vocabulary-wide warp and log-softmax, and at T=1 no support for the draws), in one process, interleaved. Host = a
step's wall time minus the time inside the packaged graphs' calls; bf16, ShareGPT dev prompts, 64 new tokens, T=1
with generate's default top-k (50), 5 rounds (median kept). Packages from run.sh's cache. Run: python host_ab.py >
host_ab.txt"""
import statistics
import time

import torch
from transformers import CompileConfig

from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
from hf_treespec.compiled import packaged
from hf_treespec.generation import draft_source

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
questions = [build_prompt(tokenizer, q) for q in sharegpt_prompts("dev", 4)]
CASES = [(1, 1.0, "dyspec", 3, {"tree_depth": 1}), (4, 0.0, "salf", 2, {})]  # (batch, T, policy, budget, extra)
MODES = {"draft vocabulary": draft_source.column_local, "whole vocabulary": lambda processors: False}
inside = [0.0]
call = packaged.PackagedGraph.__call__


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    out = call(self, *args, **kwargs)
    inside[0] += time.perf_counter() - start
    return out


packaged.PackagedGraph.__call__ = timed
print("host ms per step (wall - inside the packaged graphs) / wall ms per step; steps of the longest row")
with torch.inference_mode():
    for batch, temperature, policy, budget, extra in CASES:
        ids, mask = left_pad(questions[:batch], tokenizer.pad_token_id or 0)
        sampling = dict(do_sample=True, temperature=temperature) if temperature else dict(do_sample=False)
        kwargs = dict(assistant_model=drafter, tree_policy=policy, tree_budget=budget, max_new_tokens=64,
                      compile_config=CompileConfig(), return_dict_in_generate=True, attention_mask=mask, **sampling,
                      **extra)
        model.generate(ids, **kwargs)
        runs = {mode: [] for mode in MODES}
        for seed in range(5):
            for mode, rule in MODES.items():
                draft_source.column_local = rule
                torch.manual_seed(seed)
                inside[0] = 0.0
                start = time.perf_counter()
                out = model.generate(ids, **kwargs)
                wall = time.perf_counter() - start
                steps = max(len(row) for row in out.row_accepted_lengths)
                runs[mode].append(((wall - inside[0]) / steps, wall / steps))
        draft_source.column_local = MODES["draft vocabulary"]
        for mode in MODES:
            host, wall = (statistics.median(run[i] for run in runs[mode]) * 1e3 for i in range(2))
            print(f"batch {batch}, T={temperature:g}, {policy} {budget} node(s), {mode}: host {host:.2f} / wall "
                  f"{wall:.2f}", flush=True)
