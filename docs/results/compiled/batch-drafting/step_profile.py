"""Where a batch-4 tree step's time goes: per-call wall time of the packaged target and drafter graphs, and the loop's
draft / verify phases per step, for plain decoding and 1- and 2-node `salf` trees (four ShareGPT dev prompts,
left-padded, bf16, greedy, 64 new tokens; packages from run.sh's cache). Run: python step_profile.py > step_profile.txt"""
import collections
import time

import torch
from transformers import CompileConfig

from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
from hf_treespec.compiled import forward
from hf_treespec.generation.plain import plain_generate

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
ids, mask = left_pad([build_prompt(tokenizer, q) for q in sharegpt_prompts("dev", 4)], tokenizer.pad_token_id or 0)
common = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, compile_config=CompileConfig(),
              return_dict_in_generate=True)
methods = {"plain": dict(custom_generate=plain_generate)}
methods.update({f"salf, {n} node(s)": dict(assistant_model=drafter, tree_policy="salf", tree_budget=n) for n in (1, 2)})
calls = collections.defaultdict(list)
call = forward.CompiledForward.__call__


def timed(self, input_ids, *args, **kwargs):
    start = time.perf_counter()
    out = call(self, input_ids, *args, **kwargs)
    calls[(self.role, self.graph_name(*input_ids.shape), tuple(input_ids.shape))].append(time.perf_counter() - start)
    return out


with torch.inference_mode():
    for kwargs in methods.values():  # packages loaded, warmed
        model.generate(ids, **common, **kwargs)
    forward.CompiledForward.__call__ = timed
    for name, kwargs in methods.items():
        calls.clear()
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            out = model.generate(ids, **common, **kwargs)
            walls.append(time.perf_counter() - start)
        rows = getattr(out, "row_accepted_lengths", None)
        steps = max(len(r) for r in rows) if rows else out.sequences.shape[1] - ids.shape[1]
        print(f"## {name}: median wall {sorted(walls)[1] * 1e3:.0f} ms for 4 x 64 tokens, {steps} steps")
        if rows:
            print(f"   per step (last run): draft {out.draft_seconds / steps * 1e3:.1f} ms, verify "
                  f"{out.verify_seconds / steps * 1e3:.1f} ms; tau {sum(map(sum, rows)) / sum(map(len, rows)):.2f}")
        for key, values in sorted(calls.items(), key=lambda item: -sum(item[1])):
            values = sorted(values)
            print(f"   {key[0]:8s} {key[1]:26s} {str(key[2]):9s} calls {len(values):4d}  median "
                  f"{values[len(values) // 2] * 1e3:6.2f} ms  total {sum(values) * 1e3:6.0f} ms")
