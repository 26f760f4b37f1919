"""Batched drafting against row-by-row drafting, on the same batch in the same process.

A batch's rows draft in rounds: one drafter forward answers every row's request of a round
(``Drafter.expand_rows``). This script times the same batched ``generate`` twice per repeat, once as shipped and
once with the drafter's ``expand_rows`` swapped for the base class's row-by-row default (one forward per row per
round), and prints tokens/s and the loop's draft / verify time split for both next to plain batched ``generate``:

    PYTHONPATH=. python examples/batched_drafting.py --batch-size 4 --tree-budget 4 --dtype fp32

Outputs are checked to be identical (the two paths draft the same trees).
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_treespec
from hf_treespec.assets import default_drafter, load_questions, load_target
from hf_treespec.drafters.base import Drafter
from hf_treespec.drafters.feature_adapter import FeatureDrafter
from hf_treespec.cost.hardware import detect


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--tree-budget", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    model, tok = load_target("smollm2-135m-instruct", dtype=dtype)
    model = hf_treespec.enable(model)
    drafter = default_drafter(model)
    questions = [q.turns[0] for q in load_questions(limit=args.batch_size)]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    tree = dict(assistant_model=drafter, tree_policy="salf", tree_budget=args.tree_budget,
                return_dict_in_generate=True)
    batched = FeatureDrafter.__dict__["expand_rows"]
    row_by_row = classmethod(Drafter.expand_rows.__func__)
    print(f"{detect(model.device).describe()}; {args.dtype}, batch {args.batch_size}, SALF budget {args.tree_budget}")
    model.generate(**batch, **kwargs)  # warm-up
    for repeat in range(args.repeats):
        t0 = time.perf_counter()
        plain = model.generate(**batch, **kwargs)
        plain_seconds = time.perf_counter() - t0
        tokens = int((plain[:, batch.input_ids.shape[1]:] != kwargs["pad_token_id"]).sum())
        print(f"repeat {repeat}: plain {tokens / plain_seconds:.1f} tok/s")
        for name, expand_rows in (("row by row", row_by_row), ("batched", batched)):
            FeatureDrafter.expand_rows = expand_rows
            t0 = time.perf_counter()
            out = model.generate(**batch, **kwargs, **tree)
            seconds = time.perf_counter() - t0
            print(f"  {name:10s} {tokens / seconds:.1f} tok/s ({plain_seconds / seconds:.2f}x plain), draft "
                  f"{out.draft_seconds:.2f} s / verify {out.verify_seconds:.2f} s, drafter forwards "
                  f"{out.draft_forwards}, identical {torch.equal(out.sequences, plain)}")
    FeatureDrafter.expand_rows = batched


if __name__ == "__main__":
    main()
