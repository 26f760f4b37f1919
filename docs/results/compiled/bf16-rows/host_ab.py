"""Host time a batch-1 T=1 tree step spends outside the compiled graphs, in ONE process, with this folder's change
switched on and off: ``on`` leaves a step's target logits in bf16 unless returned (each row cast where generate's
processors read it), ``off`` casts the step's rows x vocabulary to fp32 and keeps the path's rows, as every run with
processors did before (`TreeDecodingLoop.keeps_rows` forced True). Variants alternate call by call, ten rounds,
after a warm-up; per step: (wall time of a call - time inside the packaged graphs' calls, `packaged_time`) /
steps. DySpec, one layer of 4 siblings, bf16, 2 threads, one ShareGPT dev prompt x 64 new tokens, seeded per round.
Usage: python host_ab.py (after run.sh built the packages)."""
import statistics
import time

import torch
from transformers import CompileConfig

from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
from hf_treespec.compiled.forward import packaged_time
from hf_treespec.generation import loop

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
ids, mask = left_pad([build_prompt(tokenizer, sharegpt_prompts("dev", 1)[0])], tokenizer.pad_token_id or 0)
init = loop.TreeDecodingLoop.__init__
CAST_ALL = [False]


def patched_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    if CAST_ALL[0]:
        self.keeps_rows = True


loop.TreeDecodingLoop.__init__ = patched_init
VARIANTS = {"on": False, "off": True}  # name: every row cast to fp32 and the path's rows kept
kwargs = dict(max_new_tokens=64, compile_config=CompileConfig(), return_dict_in_generate=True, attention_mask=mask,
              do_sample=True, temperature=1.0, assistant_model=drafter, tree_policy="dyspec", tree_budget=4,
              tree_depth=1)
host = {name: [] for name in VARIANTS}
wall = {name: [] for name in VARIANTS}
with torch.inference_mode():
    for name in VARIANTS:
        CAST_ALL[0] = VARIANTS[name]
        model.generate(ids, **kwargs)
    for round_ in range(10):
        names = list(VARIANTS) if round_ % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            CAST_ALL[0] = VARIANTS[name]
            torch.manual_seed(round_)
            graphs, start = packaged_time(model, drafter), time.perf_counter()
            out = model.generate(ids, **kwargs)
            seconds = time.perf_counter() - start
            steps = max(len(row) for row in out.row_accepted_lengths)
            host[name].append((seconds - (packaged_time(model, drafter) - graphs)) / steps * 1e3)
            wall[name].append(seconds / steps * 1e3)
differences = [a - b for a, b in zip(host["on"], host["off"])]
for name in VARIANTS:
    print(f"{name}: host {statistics.median(host[name]):.2f} ms a step, wall {statistics.median(wall[name]):.2f} ms a "
          f"step (rounds: {', '.join(f'{h:.2f}' for h in host[name])})")
print(f"on - off, paired by round: median {statistics.median(differences):+.2f} ms a step "
      f"({sum(d < 0 for d in differences)} of {len(differences)} rounds lower)")
