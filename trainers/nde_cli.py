"""``hf-treespec train nde-data`` (block-efficiency estimates per delayed-expansion action) and ``nde`` (the delay
selector trained on them)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_treespec.hardware import AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES, DTYPES, resolve_dtype_name

from .cli_common import (
    add_common_options, add_config_command, add_short_flags, config_from_args, int_list, resume_field, resume_from,
    run_overrides, save_final, set_threads,
)


# ------------------------------------------------------------------------------------------------------- NDE
def add_nde_data_parser(commands) -> None:
    p = commands.add_parser("nde-data", help="offline block-efficiency / step-time estimates per (k, l1, l2) action "
                                             "for the NDE delay selector", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_options(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--split", default="train", choices=["train", "dev"], help="ShareGPT split (first user turns)")
    source.add_argument("--questions", default=None, help="an MT-bench / Spec-Bench style question.jsonl instead")
    p.add_argument("--skip", type=int, default=0, help="skip the first N prompts of the source")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-prompt-length", type=int, default=1536, help="skip prompts longer than this (tokens)")
    p.add_argument("--drafter", required=True,
                   help="truncated:K (target's first K layers), a feature drafter folder or a causal-LM checkpoint")
    p.add_argument("--output", default=None, help="output folder (default: runs/nde/data-<split>-T<temperature>)")
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES,
                   help=f"target / drafter dtype; {AUTO_DTYPE_HELP}")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (verifier greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None, help="default off")
    p.add_argument("--verifier", default=None, help="top-down verifier(s) to estimate for, comma-separated (default: "
                                                    "specinfer when sampling, greedy at temperature 0); specinfer, "
                                                    "spectr, khisti_priority, naivetree, nss. Several share the trajectories, "
                                                    "trees and target forwards; the first is the folder's own")
    p.add_argument("--max-new-tokens", type=int, default=256, help="trajectory length per prompt")
    p.add_argument("--root-every", type=int, default=16, help="a root every N generated tokens")
    p.add_argument("--num-samples", type=int, default=8, help="delayed trees per root (drafting-noise average)")
    p.add_argument("--trees-per-forward", type=int, default=4, help="samples merged into one target forward")
    # trees of at most 3 + 4 x 4 = 19 drafts: on CPU a target forward grows with the tree
    p.add_argument("--paths", type=int_list, default=[1, 2, 4], help="k values")
    p.add_argument("--trunks", type=int_list, default=[0, 1, 2, 3], help="l1 values")
    p.add_argument("--branches", type=int_list, default=[1, 2, 3, 4], help="l2 values")
    p.add_argument("--chunk-size", type=int, default=5, help="prompts per resumable chunk")
    p.add_argument("--latency-repeats", type=int, default=3, help="repeats per microbenchmark point")
    p.add_argument("--latency-contexts", type=int_list, default=[64, 256, 768], help="context lengths benchmarked")
    p.add_argument("--step-overhead", type=float, default=0.0,
                   help="seconds per step outside the forwards (verification, bookkeeping) added to every action")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_nde_data)


def _nde_prompts(args, tokenizer) -> list:
    from hf_treespec.assets import load_questions, sharegpt_prompts
    from hf_treespec.benchmark.loading import build_prompt

    limit = args.skip + args.num_prompts
    questions = (load_questions(args.questions, limit) if args.questions else sharegpt_prompts(args.split, limit))
    prompts = [build_prompt(tokenizer, q) for q in questions[args.skip :]]
    return [ids for ids in prompts if ids.shape[1] <= args.max_prompt_length]


def run_nde_data(args: argparse.Namespace) -> int:
    from hf_treespec.assets import load_target
    from hf_treespec.benchmark.loading import load_drafter
    from hf_treespec.drafters import TreeSpecDrafterModel

    from .latency import measure_latency
    from .nde_data import NDEDataConfig, generate_nde_data, load_nde_data

    set_threads(args)
    verifiers = [v.strip() for v in (args.verifier or ("greedy" if args.temperature == 0 else "specinfer")).split(",")
                 if v.strip()]
    config = NDEDataConfig(
        paths=args.paths, trunks=args.trunks, branches=args.branches, verifier=verifiers[0],
        extra_verifiers=verifiers[1:],
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
        root_every=args.root_every, num_samples=args.num_samples, trees_per_forward=args.trees_per_forward,
        chunk_size=args.chunk_size, seed=args.seed, target=args.target, drafter=args.drafter,
    )
    tag = "questions" if args.questions else args.split
    output = Path(args.output or f"runs/nde/data-{tag}-T{args.temperature:g}")
    dtype = resolve_dtype_name(args.dtype)
    model, tokenizer = load_target(args.target, dtype=DTYPES[dtype])
    drafter = load_drafter(args.drafter, model, dtype)
    if isinstance(drafter, TreeSpecDrafterModel) and not drafter.is_attached:
        drafter.tie_to_target(model)
    prompts = _nde_prompts(args, tokenizer)
    start = time.perf_counter()
    latency = None
    if not (output / "nde_data.json").is_file():
        latency = measure_latency(model, drafter, contexts=args.latency_contexts, repeats=args.latency_repeats,
                                  overhead=args.step_overhead)
    generate_nde_data(model, drafter, prompts, output, config, latency=latency, progress=not args.no_progress)
    data = load_nde_data(output)
    columns = data.dataset.with_format("torch")[:]
    tau, seconds = columns["block_efficiency"].double(), columns["seconds"].double()
    static = (tau.sum(0) / seconds.sum(0))
    best = int(static.argmax())
    oracle = float(tau.gather(1, (tau / seconds).argmax(1, keepdim=True)).sum()
                   / seconds.gather(1, (tau / seconds).argmax(1, keepdim=True)).sum())
    summary = {"output": str(output), "prompts": len(prompts), "roots": len(data),
               "prompts_dropped": args.num_prompts - len(prompts),  # too long, or the source ran out
               "seconds": round(time.perf_counter() - start, 1), "actions": len(data.actions),
               "best_static_action": list(data.actions[best]), "best_static_tau": round(float(tau[:, best].mean()), 3),
               "best_static_tokens_per_s": round(float(static[best]), 2),
               "per_root_oracle_tokens_per_s": round(oracle, 2)}
    print(json.dumps(summary))
    return 0


@dataclass
class NDERunArguments:
    """What ``hf-treespec train nde`` needs besides ``NDEConfig``."""

    data: list[str] = field(metadata={"help": "nde-data folder(s) (e.g. one per temperature)"})
    eval_data: list[str] | None = field(default=None, metadata={"help": "held-out nde-data folder(s)"})
    shared_dim: int = field(default=64, metadata={"help": "d, projection width of the hidden-state input"})
    dropout: float = field(default=0.1, metadata={"help": "selector dropout"})
    no_hidden: bool = field(default=False, metadata={"help": "scalar features only (no target hidden state)"})
    latency_features: bool = field(default=False, metadata={
        "help": "also feed the measured draft / target latencies (useful when --data mixes machines)"})
    feature_set: str = field(default="root", metadata={
        "help": "selector inputs: 'root' (ours: target hidden state + root scalars) or 'paper' (Appendix E: adds the "
                "drafter's hidden state, p / q KL and L1 at the parent, latencies)", "choices": ["root", "paper"]})
    verifier: str | None = field(default=None, metadata={
        "help": "train for this verifier's block efficiency (default: the data's own; or one of its extra verifiers)"})
    resume: str | None = resume_field()
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    no_progress: bool = field(default=False, metadata={"help": "hide progress bars"})


def add_nde_parser(commands) -> None:
    from .nde import NDEConfig

    parser = add_config_command(commands, "nde", [NDEConfig, NDERunArguments], run_nde,
                                help="train the NDE delay selector (tree_policy='nde') on nde-data",
                                output_dir="runs/nde")
    add_short_flags(parser)


def run_nde(args: argparse.Namespace) -> int:
    from .nde import NDEConfig, NDETrainer, build_selector
    from .nde_data import load_nde_data

    set_threads(args)
    data = load_nde_data(args.data, args.verifier)
    eval_data = load_nde_data(args.eval_data, args.verifier) if args.eval_data else None
    selector = build_selector(data, shared_dim=args.shared_dim, dropout=args.dropout, use_hidden=not args.no_hidden,
                              latency_features=args.latency_features, feature_set=args.feature_set)
    training_args = config_from_args(NDEConfig, args, **run_overrides(args, eval_data))
    trainer = NDETrainer(selector, training_args, train_dataset=data, eval_dataset=eval_data)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume_from(args))
    summary = {"output_dir": args.output_dir, "steps": result.global_step, "roots": len(data),
               "train_loss": round(result.training_loss, 4), "seconds": round(time.perf_counter() - start, 1),
               "baseline_actions": selector.config.baseline_actions}
    if eval_data is not None:
        summary["eval"] = {k: round(v, 4) for k, v in trainer.evaluate().items() if isinstance(v, float)}
    save_final(trainer, args.output_dir, summary)
    return 0
