"""``hf-treespec train nde-data`` (block-efficiency estimates per delayed-expansion action) and ``nde`` (the delay
selector trained on them)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_treespec.api import (
    AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES, DTYPES, resolve_dtype_name, HelpFormatter, add_options,
    build_config, comma_list, option,
)


from .common import (
    TargetArguments, add_config_command, add_short_flags, resume_field, resume_from,
    run_overrides, save_final, set_threads,
)


# ------------------------------------------------------------------------------------------------------- NDE
@dataclass
class NDEDataArguments:
    """What ``hf-treespec train nde-data`` needs besides :class:`~.nde_data.NDEDataConfig`."""

    drafter: str = field(metadata=option(
        "truncated:K (target's first K layers), a feature drafter folder or a causal-LM checkpoint"))
    split: str = field(default="train", metadata=option(
        "ShareGPT split (first user turns)", choices=("train", "dev"), group="source"))
    questions: str | None = field(default=None, metadata=option(
        "an MT-bench / Spec-Bench style question.jsonl instead", group="source"))
    skip: int = field(default=0, metadata=option("skip the first N prompts of the source"))
    num_prompts: int = field(default=50, metadata=option("prompts to use"))
    max_prompt_length: int = field(default=1536, metadata=option("skip prompts longer than this (tokens)"))
    output: str | None = field(default=None, metadata=option(
        "output folder (default: runs/nde/data-<split>-T<temperature>)"))
    dtype: str = field(default=AUTO_DTYPE, metadata=option(
        f"target / drafter dtype; {AUTO_DTYPE_HELP}", choices=DTYPE_CHOICES))
    verifier: list[str] | None = field(default=None, metadata=option(
        "top-down verifier(s) to estimate for, comma-separated (default: specinfer when sampling, greedy at "
        "temperature 0); specinfer, spectr, khisti_priority, naivetree, nss. Several share the trajectories, trees "
        "and target forwards; the first is the folder's own", parse=comma_list(str)))
    latency_repeats: int = field(default=3, metadata=option("repeats per microbenchmark point"))
    latency_contexts: list[int] = field(default_factory=lambda: [64, 256, 768], metadata=option(
        "context lengths benchmarked", parse=comma_list(int)))
    step_overhead: float = field(default=0.0, metadata=option(
        "seconds per step outside the forwards (verification, bookkeeping) added to every action"))


def add_nde_data_parser(commands) -> None:
    from ..data.nde_data import NDEDataConfig

    p = commands.add_parser("nde-data", help="offline block-efficiency / step-time estimates per (k, l1, l2) action "
                                             "for the NDE delay selector", formatter_class=HelpFormatter)
    add_options(p, TargetArguments, NDEDataArguments, NDEDataConfig)
    p.set_defaults(handler=run_nde_data)


def _nde_prompts(args, tokenizer) -> list:
    from hf_treespec.api import load_questions, sharegpt_prompts, build_prompt

    limit = args.skip + args.num_prompts
    questions = (load_questions(args.questions, limit) if args.questions else sharegpt_prompts(args.split, limit))
    prompts = [build_prompt(tokenizer, q) for q in questions[args.skip :]]
    return [ids for ids in prompts if ids.shape[1] <= args.max_prompt_length]


def run_nde_data(args: argparse.Namespace) -> int:
    from hf_treespec.api import load_target, load_drafter, TreeSpecDrafterModel

    from ..evaluation.latency import measure_latency
    from ..data.nde_data import NDEDataConfig
    from ..data.nde_dataset import generate_nde_data, load_nde_data

    set_threads(args)
    verifiers = args.verifier or ["greedy" if args.temperature == 0 else "specinfer"]
    config = build_config(NDEDataConfig, args, verifier=verifiers[0], extra_verifiers=verifiers[1:],
                          target=args.target, drafter=args.drafter)
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
    from ..objectives.nde import NDEConfig

    parser = add_config_command(commands, "nde", [NDEConfig, NDERunArguments], run_nde,
                                help="train the NDE delay selector (tree_policy='nde') on nde-data",
                                output_dir="runs/nde")
    add_short_flags(parser)


def run_nde(args: argparse.Namespace) -> int:
    from ..objectives.nde import NDEConfig, NDETrainer, build_selector
    from ..data.nde_dataset import load_nde_data

    set_threads(args)
    data = load_nde_data(args.data, args.verifier)
    eval_data = load_nde_data(args.eval_data, args.verifier) if args.eval_data else None
    selector = build_selector(data, shared_dim=args.shared_dim, dropout=args.dropout, use_hidden=not args.no_hidden,
                              latency_features=args.latency_features, feature_set=args.feature_set)
    training_args = build_config(NDEConfig, args, **run_overrides(args, eval_data))
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
