"""Host time a tree step spends outside the compiled graphs, for the hf_treespec code on PYTHONPATH: wall time of
a call minus the time inside the packaged graphs' calls, per step, median of three seeded calls after a warm-up.
Cases: batch 1 at T=1 with DySpec's one layer of three siblings; batch 4 greedy with SALF's 2-node trees. bf16,
ShareGPT dev prompts, 64 new tokens, 2 threads. `host_ab.sh` runs it for two commits in alternation.

Both commits trace the same graphs (only host code differs), so both load the packages the newer code built:
``HOST_AB_DIGEST`` names them (the package key's source digest, which covers every Python file of the package).
Usage: HOST_AB_DIGEST=<digest> PYTHONPATH=<code root> python host_ab.py CASE"""
import os
import statistics
import sys
import time

import torch
from transformers import CompileConfig

from hf_treespec.compiled import packaged

packaged._source_digest = lambda: os.environ["HOST_AB_DIGEST"]

from hf_treespec.assets import sharegpt_prompts  # noqa: E402
from hf_treespec.benchmark.batched import left_pad  # noqa: E402
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model  # noqa: E402

CASES = {  # name: (batch, sampling, tree kwargs)
    "b1-t1-dyspec-3": (1, dict(do_sample=True, temperature=1.0), dict(tree_policy="dyspec", tree_budget=3,
                                                                      tree_depth=1)),
    "b4-greedy-salf-2": (4, dict(do_sample=False), dict(tree_policy="salf", tree_budget=2)),
}
batch, sampling, tree = CASES[sys.argv[1]]
torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
prompts = [build_prompt(tokenizer, q) for q in sharegpt_prompts("dev", 4)][:batch]
ids, mask = left_pad(prompts, tokenizer.pad_token_id or 0)
inside = [0.0]
call = packaged.PackagedGraph.__call__


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    out = call(self, *args, **kwargs)
    inside[0] += time.perf_counter() - start
    return out


packaged.PackagedGraph.__call__ = timed
kwargs = dict(max_new_tokens=64, compile_config=CompileConfig(), return_dict_in_generate=True, attention_mask=mask,
              assistant_model=drafter, **sampling, **tree)
host, wall = [], []
with torch.inference_mode():
    model.generate(ids, **kwargs)
    for seed in range(3):
        torch.manual_seed(seed)
        inside[0] = 0.0
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
        steps = max(len(row) for row in out.row_accepted_lengths)
        host.append((seconds - inside[0]) / steps * 1e3)
        wall.append(seconds / steps * 1e3)
print(f"{sys.argv[1]}: host {statistics.median(host):.2f} ms a step, wall {statistics.median(wall):.2f} ms a step")
