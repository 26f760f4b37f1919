"""Host work per tree step: a step's wall time minus the time inside the packaged graphs' calls (target and drafter),
per step, for trees of run.sh (ShareGPT dev prompts, bf16, 64 new tokens, 3 repeats after a warm-up, median kept; the
prompt forward counts in both: its graph time in "graphs", its host time in "host"). Packages from run.sh's cache.
Run: python host_time.py > host_time.txt"""
import statistics
import time

import torch
from transformers import CompileConfig

from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
from hf_treespec.compiled import packaged

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
questions = [build_prompt(tokenizer, q) for q in sharegpt_prompts("dev", 4)]
CASES = [  # (batch, temperature, policy, budget)
    (1, 0.0, "salf", 4), (1, 1.0, "dyspec", 4), (1, 1.0, "salf", "auto"), (4, 0.0, "salf", 1),
    (4, 1.0, "dyspec", 4), (4, 1.0, "salf", "auto"),
]
inside = [0.0]
call = packaged.PackagedGraph.__call__


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    out = call(self, *args, **kwargs)
    inside[0] += time.perf_counter() - start
    return out


packaged.PackagedGraph.__call__ = timed
print("per step (ms): host = wall - inside the packaged graphs; steps of the longest row")
with torch.inference_mode():
    for batch, temperature, policy, budget in CASES:
        ids, mask = left_pad(questions[:batch], tokenizer.pad_token_id or 0)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature else dict(do_sample=False)
        kwargs = dict(assistant_model=drafter, tree_policy=policy, tree_budget=budget, max_new_tokens=64,
                      compile_config=CompileConfig(), return_dict_in_generate=True, attention_mask=mask, **sampling)
        model.generate(ids, **kwargs)
        runs = []
        for seed in range(3):
            torch.manual_seed(seed)
            inside[0] = 0.0
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            wall = time.perf_counter() - start
            steps = max(len(row) for row in out.row_accepted_lengths)
            tau = sum(map(sum, out.row_accepted_lengths)) / sum(map(len, out.row_accepted_lengths))
            runs.append(((wall - inside[0]) / steps, inside[0] / steps, wall / steps, tau))
        host, graphs, wall, tau = (statistics.median(run[i] for run in runs) for i in range(4))
        size = "auto" if budget == "auto" else f"{budget} node(s)"
        print(f"batch {batch}, T={temperature:g}, {policy} {size}: host {host * 1e3:.2f}, graphs "
              f"{graphs * 1e3:.2f} (prompt forward included), wall {wall * 1e3:.2f}; tau {tau:.2f}", flush=True)
