"""Host milliseconds per tree step with and without this folder's two host cuts, in one process, interleaved: the
packaged graphs called with their flat tensors (`FlatCall`) or through the loaded model's own call, and the kept KV
rows moved by one op call (`row_moves`) or by each layer's torch ops. Host = a step's wall time minus the time inside
the packaged graphs' calls; bf16, ShareGPT dev prompts, 64 new tokens, 5 rounds (median kept). Packages from
run.sh's cache. Run: python host_ab.py > host_ab.txt"""
import statistics
import time

import torch
from transformers import CompileConfig

from hf_treespec.assets import sharegpt_prompts
from hf_treespec.benchmark.batched import left_pad
from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
from hf_treespec.compiled import packaged, row_moves
from hf_treespec.kv import ragged, tree_kv

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
drafter = load_drafter("default", model, "bf16")
questions = [build_prompt(tokenizer, q) for q in sharegpt_prompts("dev", 4)]
CASES = [(1, 1.0, "dyspec", 3, {"tree_depth": 1}), (4, 0.0, "salf", 2, {})]  # (batch, T, policy, budget, extra)
MODES = {"both cuts": (True, True), "torch row moves": (True, False), "the package's own call": (False, True)}
inside = [0.0]
seen: set = set()  # every package called (the warm-up call runs each one a case needs)
call = packaged.PackagedGraph.__call__
flat_calls: dict = {}  # each loaded package's FlatCall, put back when a mode flattens again


def timed(self, *args, **kwargs):
    seen.add(self)
    start = time.perf_counter()
    out = call(self, *args, **kwargs)
    inside[0] += time.perf_counter() - start
    return out


def set_mode(flat: bool, one_op: bool) -> None:
    for package in seen:
        flat_calls.setdefault(package, package.flat)
        package.flat = flat_calls[package] if flat else None
    serves = row_moves.moves_in_one_op if one_op else (lambda buffers: False)
    tree_kv.moves_in_one_op = ragged.moves_in_one_op = serves


packaged.PackagedGraph.__call__ = timed
print("host ms per step (wall - inside the packaged graphs) / wall ms per step; steps of the longest row")
with torch.inference_mode():
    for batch, temperature, policy, budget, extra in CASES:
        ids, mask = left_pad(questions[:batch], tokenizer.pad_token_id or 0)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature else dict(do_sample=False)
        kwargs = dict(assistant_model=drafter, tree_policy=policy, tree_budget=budget, max_new_tokens=64,
                      compile_config=CompileConfig(), return_dict_in_generate=True, attention_mask=mask, **sampling,
                      **extra)
        model.generate(ids, **kwargs)
        runs = {mode: [] for mode in MODES}
        for seed in range(5):
            for mode, (flat, one_op) in MODES.items():
                set_mode(flat, one_op)
                torch.manual_seed(seed)
                inside[0] = 0.0
                start = time.perf_counter()
                out = model.generate(ids, **kwargs)
                wall = time.perf_counter() - start
                steps = max(len(row) for row in out.row_accepted_lengths)
                runs[mode].append(((wall - inside[0]) / steps, wall / steps))
        set_mode(True, True)
        for mode in MODES:
            host, wall = (statistics.median(run[i] for run in runs[mode]) * 1e3 for i in range(2))
            print(f"batch {batch}, T={temperature:g}, {policy} {budget} node(s), {mode}: host {host:.2f} / wall "
                  f"{wall:.2f}", flush=True)
