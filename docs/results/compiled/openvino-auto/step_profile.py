"""Where a 4-node tree step's time goes through the OpenVINO step: one greedy generate call (bf16, 2 threads, 128
new tokens, one MT-bench-style prompt) under cProfile after an untimed call, the top functions by cumulative time.
Usage: python step_profile.py OUT.txt"""

import cProfile
import io
import pstats
import subprocess
import sys
import time

import torch
from transformers import CompileConfig

import hf_treespec
from hf_treespec import fast_dtype
from hf_treespec.assets import default_drafter, load_target

torch.set_num_threads(2)
model, tok = load_target("smollm2-135m-instruct", dtype=fast_dtype())
drafter = default_drafter(model)
model = hf_treespec.enable(model)
inputs = tok.apply_chat_template([{"role": "user", "content": "Explain how photosynthesis works in simple terms."}],
                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)
kwargs = dict(assistant_model=drafter, tree_policy="salf", tree_budget=4, max_new_tokens=128, do_sample=False,
              compile_config=CompileConfig(backend="openvino"), return_dict_in_generate=True)
model.generate(**inputs, **kwargs)
start = time.perf_counter()
out = model.generate(**inputs, **kwargs)
seconds = time.perf_counter() - start
new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
del out  # a returned cache still held would be copied out of the engine by the next call
profile = cProfile.Profile()
profile.enable()
out = model.generate(**inputs, **kwargs)
profile.disable()
steps = len(out.tree_sizes)
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("hf_treespec|openvino", 30)
cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
head = (f"{cpu}; torch {torch.__version__}, dtype {model.dtype}, 2 threads\n"
        f"timed call: {new} new tokens in {seconds:.3f} s ({1000 * seconds / new:.1f} ms a token); profiled call: "
        f"{steps} steps, tau {sum(out.accepted_lengths) / steps:.2f}, draft {out.draft_seconds:.3f} s, verify "
        f"{out.verify_seconds:.3f} s, total {out.total_seconds:.3f} s\n\n")
open(sys.argv[1], "w").write(head + text.getvalue())
print(head)
