"""tau (tokens per target forward) of prompt-lookup tree drafting for several tree shapes; timing-free.

    python examples/lookup_tree_shapes.py --num-questions 10 --max-new-tokens 128 --max-ngram 3
"""

import argparse

import torch

import hf_treespec
from hf_treespec.assets import load_questions, load_target
from hf_treespec.drafters import prompt_lookup

SHAPES = {
    "chain depth 5": dict(tree_policy="chain"),
    "chain depth 10": dict(tree_policy="chain", tree_depth=10),
    "optimal budget 8": dict(tree_policy="optimal", tree_budget=8),
    "optimal budget 12": dict(tree_policy="optimal", tree_budget=12),
    "salf budget 12": dict(tree_policy="salf", tree_budget=12),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target(dtype=torch.bfloat16)
    model = hf_treespec.enable(model)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                return_tensors="pt", return_dict=True)["input_ids"]
        for q in load_questions(limit=args.num_questions)
    ]
    for name, kwargs in SHAPES.items():
        accepted, nodes = [], []
        for ids in prompts:
            out = model.generate(ids, assistant_model=prompt_lookup(model, max_ngram_size=args.max_ngram),
                                 max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True,
                                 **kwargs)
            accepted += out.accepted_lengths
            nodes += out.tree_sizes
        print(f"{name:18s} tau {sum(accepted) / len(accepted):.3f}  nodes/step {sum(nodes) / len(nodes):.2f}",
              flush=True)


if __name__ == "__main__":
    main()
