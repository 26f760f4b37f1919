"""Where a batch-4 step's time goes through the OpenVINO step: four left-padded prompts x 64 new tokens, bf16,
2 threads, greedy. Times plain decoding through the step and a fixed 2-node `salf` tree (median of 3 calls after an
untimed one), then profiles one tree call (cProfile, top functions by cumulative time).
Usage: python step_profile.py OUT.txt"""

import cProfile
import io
import pstats
import statistics
import subprocess
import sys
import time

import torch
from transformers import CompileConfig

import hf_treespec
from hf_treespec import fast_dtype
from hf_treespec.assets import default_drafter, load_target
from hf_treespec.generation.plain import plain_generate

torch.set_num_threads(2)
model, tok = load_target("smollm2-135m-instruct", dtype=fast_dtype())
drafter = default_drafter(model)
model = hf_treespec.enable(model)
questions = ["Explain how photosynthesis works in simple terms.", "Write a short poem about the sea.",
             "What are the main causes of inflation?", "Give three tips for learning a new language."]
tok.padding_side = "left"
texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
         for q in questions]
inputs = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
common = dict(max_new_tokens=64, do_sample=False, compile_config=CompileConfig(backend="openvino"),
              return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
tree = dict(assistant_model=drafter, tree_policy="salf", tree_budget=2)
lines = []
for name, kwargs in [("plain through the step", dict(custom_generate=plain_generate)), ("2-node tree", tree)]:
    model.generate(**inputs, **common, **kwargs)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        out = model.generate(**inputs, **common, **kwargs)
        seconds.append(time.perf_counter() - start)
        del out  # a returned cache still held would be copied out of the engine by the next call
    lines.append(f"{name}: {statistics.median(seconds):.3f} s a call (median of 3)")
profile = cProfile.Profile()
profile.enable()
out = model.generate(**inputs, **common, **tree)
profile.disable()
steps = max(len(row) for row in out.row_accepted_lengths)  # target forwards after the prefill
tau = sum(out.accepted_lengths) / len(out.accepted_lengths)
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("hf_treespec|openvino", 30)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
head = (f"{cpu}; torch {torch.__version__}, dtype {model.dtype}, 2 threads, batch 4 x 64 new tokens\n"
        + "\n".join(lines) + f"\nprofiled tree call: {steps} steps, tau {tau:.2f}, draft {out.draft_seconds:.3f} s, verify "
        f"{out.verify_seconds:.3f} s, total {out.total_seconds:.3f} s\n\n")
open(sys.argv[1], "w").write(head + text.getvalue())
print(head)
