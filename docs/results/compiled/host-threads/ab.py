"""Experiment: torch's threads on the OpenVINO step's draft-free steps, one (what the package does, `HostThreads`)
against the caller's two, paired per prompt.

Run: ``bash docs/results/compiled/host-threads/run.sh`` (bf16, 2 threads). Plain decoding through the step
(`plain_generate`) at batch 1 (four prompts, one at a time) and batch 4 (the same four, left-padded, run four times a round), and a 4-node
``salf`` tree at batch 1 (its steps all draft, so both variants should match), 64 new tokens, variants interleaved
per prompt, ``--repeats`` rounds; ms per generated token (per step at batch 4), medians and paired ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import CompileConfig

import hf_treespec
from hf_treespec.assets import default_drafter, load_target
from hf_treespec.compiled.host_threads import HostThreads

QUESTIONS = ["Write a detailed essay about the history of the Roman empire.",
             "Explain how a transformer neural network works.", "Give me ten tips for a healthy life.",
             "What are the main differences between Python and JavaScript?"]
NEW_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default="docs/results/compiled/host-threads/ab.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    model = hf_treespec.enable(model)
    drafter = default_drafter(model)
    config = CompileConfig(backend="openvino")
    singles = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True) for q in QUESTIONS]
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    batch = dict(tok(texts, return_tensors="pt", padding=True, add_special_tokens=False))
    narrow = HostThreads.narrow

    def run(case: str, inputs: dict, one_thread: bool) -> float:
        HostThreads.narrow = narrow if one_thread else (lambda self: None)
        kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, compile_config=config)
        if case == "tree 4 nodes, batch 1":
            kwargs.update(assistant_model=drafter, tree_policy="salf", tree_budget=4)
        else:
            kwargs.update(custom_generate=hf_treespec.plain_generate)
        try:
            start = time.perf_counter()
            model.generate(**inputs, **kwargs)
            return (time.perf_counter() - start) * 1e3 / NEW_TOKENS
        finally:
            HostThreads.narrow = narrow

    # the batch runs four times a round: as many pairs as the single prompts give
    cases = {"plain, batch 1": singles, "plain, batch 4": [batch] * 4, "tree 4 nodes, batch 1": singles}
    times = {(case, one): [] for case in cases for one in (True, False)}
    for repeat in range(args.repeats + 1):  # the first round warms up (a shape's first run), not kept
        for case, prompts in cases.items():
            for inputs in prompts:
                for one in (True, False):
                    seconds = run(case, inputs, one)
                    if repeat:
                        times[case, one].append(seconds)
    report = {"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" \t:"),
              "torch": torch.__version__, "dtype": "bfloat16", "threads": 2, "repeats": args.repeats}
    for case in cases:
        one, two = times[case, True], times[case, False]
        report[case] = {
            "one thread ms (median)": round(statistics.median(one), 2),
            "caller's two ms (median)": round(statistics.median(two), 2),
            "speedup of one thread (median of pairs)": round(statistics.median(b / a for a, b in zip(one, two)), 3),
            "pairs where one thread was faster": f"{sum(a < b for a, b in zip(one, two))}/{len(one)}",
            "one thread ms": [round(x, 1) for x in one], "caller's two ms": [round(x, 1) for x in two],
        }
    text = json.dumps(report, indent=1)
    print(text)
    with open(args.out, "w") as file:
        file.write(text + "\n")


if __name__ == "__main__":
    main()
