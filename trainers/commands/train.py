"""``hf-treespec train eagle | hass | talf | ttt`` (a drafter trained on prepared data) and ``evaluate`` (held-out
acceptance per depth)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_treespec.api import HelpFormatter, add_options, build_config, option

from .common import (
    TargetArguments, add_config_command, add_short_flags, bf16_supported, precision_overrides,
    resume_field, resume_from, run_overrides, save_final, set_seed, set_threads,
)

#: LM-head rows of a new drafter (EAGLE-3's reduced draft vocabulary; it holds ~94% of SmolLM2's own greedy answer tokens)
DRAFT_VOCAB_SIZE = 8192


@dataclass
class DrafterRunArguments:
    """What ``hf-treespec train eagle|hass|talf|ttt`` needs besides the objective's ``TrainingArguments``."""

    data: list[str] = field(metadata={
        "help": "folder(s) written by `train prepare`, trained on together (e.g. ShareGPT's and regenerated answers)"})
    eval_data: list[str] | None = field(default=None, metadata={"help": "prepared folder(s) evaluated each epoch"})
    target: str = field(default="smollm2-135m-instruct",
                        metadata={"help": "target model: asset short name, checkpoint folder or .gguf file"})
    init: str | None = field(default=None, metadata={"help": "start from this drafter (e.g. the EAGLE warm-up)"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": f"new drafters: LM-head rows, the most frequent target tokens of --data (default {DRAFT_VOCAB_SIZE})"})
    input_mode: str = field(default="auto", metadata={
        "help": "new drafters: input layout (auto: eagle3 for data with several target layers, else fc)",
        "choices": ["auto", "fc", "eagle3"]})
    num_layers: int | None = field(default=None, metadata={
        "help": "decoder layers of a new drafter (default 1); with --init, more than it has deepens it (the new "
                "layers start as identities)"})
    precision: str = field(default="auto", metadata={
        "help": "auto: bf16 autocast where supported (CPUs with avx512_bf16, recent GPUs)",
        "choices": ["auto", "bf16", "fp32"]})
    resume: str | None = resume_field()
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    no_progress: bool = field(default=False, metadata={"help": "hide progress bars"})


def add_trainer_parser(commands, name: str) -> None:
    """``hf-treespec train <name>`` for a registered drafter trainer: its config dataclass + `DrafterRunArguments`."""
    from .. import TRAINERS

    parser = add_config_command(commands, name, [TRAINERS[name].config_class, DrafterRunArguments], run_train,
                                help=f"train a drafter with the {name.upper()} objective", objective=name,
                                output_dir=f"runs/{name}")
    add_short_flags(parser)


def _check_init_shape(args, config) -> None:
    """The shape flags size new drafters: with ``--init`` they must agree with the loaded one, not be ignored (except
    a larger ``--num-layers``, which deepens it: `TreeSpecDrafterModel.add_layers`)."""
    deeper = args.num_layers is not None and args.num_layers > config.num_hidden_layers
    given = {"--draft-vocab-size": (args.draft_vocab_size, config.draft_vocab_size),
             "--num-layers": (None if deeper else args.num_layers, config.num_hidden_layers),
             "--input-mode": (None if args.input_mode == "auto" else args.input_mode, config.input_mode)}
    clashes = [f"{flag} {wanted} (it has {has})" for flag, (wanted, has) in given.items()
               if wanted is not None and wanted != has]
    if clashes:
        raise ValueError(f"--init {args.init} is a trained drafter, but {', '.join(clashes)} asks for another shape: "
                         "these flags size new drafters only (a larger --num-layers deepens one); drop them to train "
                         "on from --init.")


def build_drafter(args, target, data):
    """The drafter to train: ``--init`` loaded, or a new one sized from the target and the data's token counts."""
    import torch

    from hf_treespec.api import TreeSpecDrafterConfig, TreeSpecDrafterModel, build_draft_vocab

    if args.init:
        # fp32 master weights whatever the checkpoint holds (the shipped drafter is bf16): optimizer updates below
        # bf16's resolution would be lost, and mixed precision is the autocast of --precision, not the weights'
        drafter = TreeSpecDrafterModel.from_pretrained(args.init, dtype=torch.float32)
        if drafter.config.target_layers != data.config.target_layers:
            raise ValueError(f"--init reads target layers {drafter.config.target_layers}, but --data was prepared "
                             f"with {data.config.target_layers}.")
        _check_init_shape(args, drafter.config)
        if args.num_layers is not None:
            drafter.add_layers(args.num_layers)  # identity-initialised layers: training starts from --init's drafts
        return drafter.tie_to_target(target)
    vocab = target.config.get_text_config().vocab_size
    size = min(DRAFT_VOCAB_SIZE if args.draft_vocab_size is None else args.draft_vocab_size, vocab)
    from ..objectives.ttt import infer_input_mode

    input_mode = infer_input_mode(args.input_mode, data.config.target_layers)
    layers = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}  # else for_target's one
    config = TreeSpecDrafterConfig.for_target(
        target.config, target_layers=data.config.target_layers, draft_vocab_size=size, input_mode=input_mode,
        share_target_embeddings=True, share_target_lm_head=True, **layers,
    )
    drafter = TreeSpecDrafterModel(config)
    if size < vocab:
        drafter.set_draft_vocab(build_draft_vocab(data.token_counts, size)[0])
    return drafter.tie_to_target(target)


def run_train(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.api import load_target

    from .. import TRAINERS
    from ..data.prepared import load_prepared

    set_threads(args)
    trainer_cls = TRAINERS[args.objective]
    data = load_prepared(args.data)
    eval_data = load_prepared(args.eval_data) if args.eval_data else None
    if args.objective == "talf" and data.config.tree_policy is None:
        raise ValueError(f"{', '.join(data.sources)} holds no target trees: prepare with --tree-policy eagle2 for "
                         "TALF.")
    target, _ = load_target(args.target or data.config.target, dtype=torch.bfloat16)
    set_seed(args.seed)  # a new drafter's initial weights follow --seed (the same on every process)
    drafter = build_drafter(args, target, data)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and bf16_supported())
    training_args = build_config(trainer_cls.config_class, args, **precision_overrides(bf16),
                                     **run_overrides(args, eval_data))
    trainer = trainer_cls(drafter, training_args, target_model=target, train_dataset=data, eval_dataset=eval_data)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume_from(args))
    seconds = time.perf_counter() - start
    summary = {"objective": args.objective, "output_dir": args.output_dir, "steps": result.global_step,
               "train_loss": round(result.training_loss, 4), "seconds": round(seconds, 1),
               "sequences": len(data.dataset), "tokens": data.num_tokens, "bf16": bf16,
               "last_log": next((log for log in reversed(trainer.state.log_history) if "loss" in log), {})}
    save_final(trainer, args.output_dir, summary)
    return 0


# ---------------------------------------------------------------------------------------------------- evaluate
@dataclass
class EvaluateArguments:
    """``hf-treespec train evaluate``: drafters scored on held-out prepared data."""

    data: str = field(metadata=option("prepared folder with chain trees (e.g. ShareGPT dev)"))
    drafter: list[str] = field(metadata=option("drafter folder (repeatable)", repeat=True))
    batch_size: int = field(default=4, metadata=option("conversations per drafter forward"))
    output: str | None = field(default=None, metadata=option("write the results as JSON here too"))


def add_evaluate_parser(commands) -> None:
    p = commands.add_parser("evaluate", help="held-out top-1 acceptance per depth (data prepared with --tree-policy "
                                             "chain)", formatter_class=HelpFormatter)
    add_options(p, TargetArguments, EvaluateArguments)
    p.set_defaults(handler=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.api import load_target, TreeSpecDrafterModel

    from ..data.prepared import load_prepared
    from ..evaluation.acceptance import acceptance_by_depth
    from ..objectives.losses import TargetHead

    set_threads(args)
    data = load_prepared(args.data)
    target, _ = load_target(args.target, dtype=torch.bfloat16)
    head = TargetHead.from_target(target)
    results = {}
    for folder in args.drafter:
        drafter = TreeSpecDrafterModel.from_pretrained(folder).tie_to_target(target)
        if drafter.config.target_layers != data.config.target_layers:
            raise ValueError(f"{folder} reads target layers {drafter.config.target_layers}, but {args.data} was "
                             f"prepared with {data.config.target_layers}: prepare the evaluation data with the "
                             "drafter's --input-mode / --target-layers.")
        start = time.perf_counter()
        results[folder] = acceptance_by_depth(drafter, data, head, args.batch_size, progress=not args.no_progress)
        results[folder]["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({folder: results[folder]}))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0
