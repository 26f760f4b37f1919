"""``hf-treespec train c2t-data | c2t | static-shape``: the C2T classifier and Sequoia's static shape."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_treespec.api import (
    HelpFormatter, add_options, build_config, comma_list, option, AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES,
    DTYPES, resolve_dtype_name,
)


@dataclass
class C2TDataArguments:
    """What ``hf-treespec train c2t-data`` needs besides :class:`~.c2t.C2TDataConfig`."""

    drafter: str = field(default="default", metadata=option(
        "default (the shipped drafter), truncated:K, or a folder"))
    skip: int = field(default=0, metadata=option("skip the first N train prompts"))
    num_prompts: int = field(default=150, metadata=option("prompts to use"))
    max_prompt_length: int = field(default=768, metadata=option("skip prompts longer than this (tokens)"))
    dtype: str = field(default=AUTO_DTYPE, metadata=option(
        f"target / drafter dtype; {AUTO_DTYPE_HELP}", choices=DTYPE_CHOICES))
    chunk_size: int = field(default=10, metadata=option("prompts per resumable chunk file"))
    output: str = field(default="runs/c2t/data", metadata=option(
        "output folder (rerun the same command to resume)"))


@dataclass
class StaticShapeArguments:
    """``hf-treespec train static-shape``: Sequoia's shape from c2t-data's per-rank acceptance."""

    data: str = field(metadata=option("c2t-data folder"))
    budget: list[int] = field(default_factory=lambda: [60], metadata=option(
        "node budgets, comma-separated (several: pick by cost)", parse=comma_list(int)))
    depth: int | None = field(default=None, metadata=option("maximum depth"))
    cost: str | None = field(default=None, metadata=option(
        "verification cost curve 'nodes:seconds,...' (+ --draft-seconds per level); with several budgets the shape "
        "of most tokens per second is chosen"))
    draft_seconds: float = field(default=0.0, metadata=option("seconds of one draft forward (per level)"))


def add_c2t_commands(commands, threads) -> None:
    from ..objectives.c2t import C2TDataConfig
    from .common import TargetArguments

    p = commands.add_parser("c2t-data", help="full EAGLE-2 trees on ShareGPT train prompts, nodes labelled by the "
                                             "target's greedy acceptance (C2T classifier data)",
                            formatter_class=HelpFormatter)
    add_options(p, TargetArguments, C2TDataArguments, C2TDataConfig)
    p.set_defaults(handler=lambda args: run_c2t_data(args, threads))

    from ..objectives.c2t import C2TConfig
    from .common import add_short_flags, add_config_command

    parser = add_config_command(commands, "c2t", [C2TConfig, C2TRunArguments], lambda args: run_c2t(args, threads),
                                help="train the C2T confidence classifier (tree_policy='c2t') on c2t-data",
                                output_dir="runs/c2t")
    add_short_flags(parser)

    p = commands.add_parser("static-shape", help="Sequoia's optimal static tree (tree_shape=) from the per-rank "
                                                 "acceptance measured in c2t-data",
                            formatter_class=HelpFormatter)
    add_options(p, StaticShapeArguments)
    p.set_defaults(handler=run_static_shape)


def _prompts(args, tokenizer) -> list:
    from hf_treespec.api import sharegpt_prompts, build_prompt

    questions = sharegpt_prompts("train", args.skip + args.num_prompts)[args.skip :]
    prompts = [build_prompt(tokenizer, q) for q in questions]
    return [ids for ids in prompts if ids.shape[1] <= args.max_prompt_length]


def run_c2t_data(args, threads) -> int:
    from hf_treespec.api import load_target, load_drafter

    from ..objectives.c2t import C2TDataConfig, generate_c2t_data, rank_acceptance

    threads(args)
    args.dtype = resolve_dtype_name(args.dtype)  # recorded concretely: a resume on another machine must match
    dtype = DTYPES[args.dtype]
    model, tokenizer = load_target(args.target, dtype=dtype)
    drafter = load_drafter(args.drafter, model, args.dtype, args.target)
    config = build_config(C2TDataConfig, args)
    start = time.perf_counter()
    prompts = _prompts(args, tokenizer)
    settings = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype, "skip": args.skip,
                "max_prompt_length": args.max_prompt_length}
    data = generate_c2t_data(model, drafter, prompts, config, args.output, chunk_size=args.chunk_size,
                             settings=settings, progress=not args.no_progress)
    summary = {"output": args.output, "prompts": len(prompts), "nodes": len(data), "positives": int(sum(data["label"])),
               "rank_acceptance": [round(a, 4) for a in rank_acceptance(data)],
               "seconds": round(time.perf_counter() - start, 1), "config": vars(config)}
    (Path(args.output) / "c2t_data.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


@dataclass
class C2TRunArguments:
    """What ``hf-treespec train c2t`` needs besides ``C2TConfig``."""

    data: str = field(metadata={"help": "c2t-data folder"})
    hidden_size: int = field(default=48, metadata={"help": "hidden width of the 2-layer classifier"})
    features: str = field(default="joint_prob,parent_entropy,depth",
                          metadata={"help": "comma list of the features the classifier reads (a subset of "
                                            "joint_prob, parent_entropy, depth: the paper's feature ablation)"})
    eval_fraction: float = field(default=0.05, metadata={"help": "held-out share of the trees (by prompt)"})
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})


def run_c2t(args, threads) -> int:
    from hf_treespec.api import C2TClassifier, C2TClassifierConfig

    from ..objectives.c2t import C2TConfig, C2TTrainer, load_c2t_data

    from .common import save_final

    threads(args)
    data = load_c2t_data(args.data)
    prompts = sorted(set(data["prompt"]))
    held = set(prompts[: int(round(args.eval_fraction * len(prompts)))])
    train = data.filter(lambda row: row["prompt"] not in held)
    evaluation = data.filter(lambda row: row["prompt"] in held) if held else None
    features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    model = C2TClassifier(C2TClassifierConfig(hidden_size=args.hidden_size, features=features))
    training_args = build_config(C2TConfig, args)
    trainer = C2TTrainer(model, training_args, train_dataset=train, eval_dataset=evaluation)
    start = time.perf_counter()
    result = trainer.train()
    summary = {"output_dir": args.output_dir, "features": list(model.config.features), "train_nodes": len(train),
               "steps": result.global_step,
               "train_loss": round(result.training_loss, 4), "seconds": round(time.perf_counter() - start, 1)}
    if evaluation is not None:
        summary.update(held_out_metrics(model, evaluation))
    save_final(trainer, args.output_dir, summary)
    return 0


def held_out_metrics(model, evaluation) -> dict:
    """Recall of accepted nodes and positive rate (the paper's two selection criteria) at a few thresholds."""
    import torch

    feats = torch.tensor(evaluation["features"], dtype=torch.float32)
    labels = torch.tensor(evaluation["label"]).bool()
    conf = model.eval().confidence(feats)
    out = {"eval_nodes": len(labels), "eval_positives": int(labels.sum())}
    for beta in (0.3, 0.5, 0.7, 0.9):
        kept = conf > beta
        out[f"beta={beta}"] = {"recall": round(float((kept & labels).sum()) / max(int(labels.sum()), 1), 4),
                               "positive_rate": round(float(kept.float().mean()), 4)}
    return out


def run_static_shape(args) -> int:
    from hf_treespec.api import choose_shape, expected_accepted, sequoia_shape

    from ..objectives.c2t import load_c2t_data, rank_acceptance

    acceptance = rank_acceptance(load_c2t_data(args.data))
    if args.cost:
        points = sorted((int(n), float(s)) for n, s in (item.split(":") for item in args.cost.split(",")))

        def step_seconds(nodes: int, depth: int) -> float:
            below = [p for p in points if p[0] <= nodes] or points[:1]
            above = [p for p in points if p[0] >= nodes] or points[-1:]
            (n0, s0), (n1, s1) = below[-1], above[0]
            verify = s0 if n1 == n0 else s0 + (s1 - s0) * (nodes - n0) / (n1 - n0)
            return verify + depth * args.draft_seconds

        shape, info = choose_shape(acceptance, args.budget, step_seconds, args.depth)
    else:
        shape = sequoia_shape(acceptance, max(args.budget), args.depth)
        info = {"nodes": len(shape), "tokens_per_step": 1 + expected_accepted(shape, acceptance)}
    print(json.dumps({"rank_acceptance": [round(a, 4) for a in acceptance], **info, "tree_shape": shape}))
    return 0
