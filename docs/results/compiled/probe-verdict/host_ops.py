"""Tensor ops the host issues per decoding step, by the hf_treespec function that issued them (the innermost
hf_treespec frame above each aten op; a TorchDispatchMode counts them), for plain decoding and two tree steps through
the compiled steps. Ops inside the packaged graphs' calls (the custom linears and attention the runner dispatches) are
counted apart. bf16, ShareGPT dev prompts, 64 new tokens, one seeded call after a warm-up. Packages from run.sh's
cache. Run: python host_ops.py > host_ops.txt"""
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig

from hf_treespec import plain_generate
from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
questions = [build_prompt(tokenizer, q) for q in sharegpt_prompts("dev", 4)]
CASES = {  # name: (batch, sampling, tree kwargs or None for plain decoding)
    "batch 1, T=1, plain": (1, dict(do_sample=True, temperature=1.0), None),
    "batch 1, T=1, dyspec one layer of 3": (1, dict(do_sample=True, temperature=1.0),
                                            dict(tree_policy="dyspec", tree_budget=3, tree_depth=1)),
    "batch 4, greedy, plain": (4, dict(do_sample=False), None),
    "batch 4, greedy, salf 2 nodes": (4, dict(do_sample=False), dict(tree_policy="salf", tree_budget=2)),
    # auto after a warm-up call: drafting is off on most steps, the loop's draft-free steps against plain decoding's
    "batch 4, greedy, salf auto": (4, dict(do_sample=False), dict(tree_policy="salf")),
}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_caller = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, where = sys._getframe(1), "(outside hf_treespec)"
        while frame is not None:
            name = frame.f_code.co_filename
            if "/hf_treespec/" in name:
                where = name.split("/hf_treespec/")[-1] + ":" + frame.f_code.co_name
                break
            frame = frame.f_back
        self.by_caller["inside the packaged graphs" if where.startswith("compiled/packaged.py") else where] += 1
        return func(*args, **(kwargs or {}))


with torch.inference_mode():
    for name, (batch, sampling, tree) in CASES.items():
        ids, mask = left_pad(questions[:batch], tokenizer.pad_token_id or 0)
        kwargs = dict(max_new_tokens=64, compile_config=CompileConfig(), return_dict_in_generate=True,
                      attention_mask=mask, **sampling)
        kwargs.update(dict(assistant_model=drafter, **tree) if tree else dict(custom_generate=plain_generate))
        model.generate(ids, **kwargs)
        torch.manual_seed(0)
        with Count() as count:
            out = model.generate(ids, **kwargs)
        steps = max(len(row) for row in out.row_accepted_lengths) if tree else 64
        drafted = f", {out.drafted_steps} of {len(out.tree_sizes)} row steps drafted" if tree else ""
        inside = count.by_caller.pop("inside the packaged graphs", 0)
        host = sum(count.by_caller.values())
        print(f"\n{name}: {steps} steps{drafted}, host ops a step {host / steps:.0f} (inside the graphs "
              f"{inside / steps:.0f})")
        for caller, ops in count.by_caller.most_common(15):
            print(f"  {ops / steps:6.1f}  {caller}")
