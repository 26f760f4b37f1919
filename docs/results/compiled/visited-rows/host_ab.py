"""Host time a batch-1 T=1 tree step spends outside the compiled graphs, in ONE process, with each of this
folder's two changes switched off in turn: ``rows`` (the target rows processed when the verifier's walk reads them,
`TopDownVerifier.reads_visited_rows`) and ``warp`` (the draft row warped over the drafter's vocabulary,
`draft_source.column_local`). Variants alternate call by call, six rounds, after a warm-up; per step: (wall time of a
call - time inside the packaged graphs' calls) / steps. DySpec, one layer of 4 siblings, bf16, 2 threads, one
ShareGPT dev prompt x 64 new tokens, seeded per round. Usage: python host_ab.py (after run.sh built the packages)."""
import statistics
import time

import torch
from transformers import CompileConfig

from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
from hf_treespec.compiled import packaged
from hf_treespec.generation import draft_source
from hf_treespec.verifiers.topdown import TopDownVerifier

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
ids, mask = left_pad([build_prompt(tokenizer, sharegpt_prompts("dev", 1)[0])], tokenizer.pad_token_id or 0)
inside = [0.0]
call = packaged.PackagedGraph.__call__


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    out = call(self, *args, **kwargs)
    inside[0] += time.perf_counter() - start
    return out


packaged.PackagedGraph.__call__ = timed
column_local = draft_source.column_local
VARIANTS = {  # name: (rows read on demand, draft row warped over the drafter's vocabulary)
    "both": (True, True), "rows off": (False, True), "warp off": (True, False),
}


def switch(rows: bool, warp: bool) -> None:
    TopDownVerifier.reads_visited_rows = rows
    draft_source.column_local = column_local if warp else (lambda processors: not len(processors))


kwargs = dict(max_new_tokens=64, compile_config=CompileConfig(), return_dict_in_generate=True, attention_mask=mask,
              do_sample=True,
              temperature=1.0, assistant_model=drafter, tree_policy="dyspec", tree_budget=4, tree_depth=1)
host = {name: [] for name in VARIANTS}
wall = {name: [] for name in VARIANTS}
with torch.inference_mode():
    for name in VARIANTS:
        switch(*VARIANTS[name])
        model.generate(ids, **kwargs)
    for round_ in range(6):
        names = list(VARIANTS) if round_ % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            switch(*VARIANTS[name])
            torch.manual_seed(round_)
            inside[0] = 0.0
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            seconds = time.perf_counter() - start
            steps = max(len(row) for row in out.row_accepted_lengths)
            host[name].append((seconds - inside[0]) / steps * 1e3)
            wall[name].append(seconds / steps * 1e3)
switch(True, True)
for name in VARIANTS:
    print(f"{name}: host {statistics.median(host[name]):.2f} ms a step, wall {statistics.median(wall[name]):.2f} ms a "
          f"step (rounds: {', '.join(f'{h:.2f}' for h in host[name])})")
