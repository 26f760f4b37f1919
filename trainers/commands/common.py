"""What every ``hf-treespec train`` command shares: the dataclass-driven parser with ``--config file.yaml``, the
options of the non-Trainer commands (``TargetArguments``), resume, threads and precision handling (configs are built
from parsed options by ``hf_treespec.cli_options.build_config``). The command modules (``cli.py``,
``gto_cli.py``, ``c2t_cli.py``) import from here, never from each other."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from transformers import HfArgumentParser

from hf_treespec.api import add_config_option, apply_config_file, option, fast_dtype


class ConfigParser(HfArgumentParser):
    """``HfArgumentParser`` (options generated from dataclasses) plus ``--config file.yaml``: the file's values
    replace the defaults, flags on the command line replace the file's (as TRL's ``TrlParser`` does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_config_option(self)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        apply_config_file(self, args)
        return super().parse_known_args(args, namespace)


def add_config_command(commands, name: str, dataclass_types: list[type], handler: Callable, help: str,
                       **cli_defaults: Any) -> ConfigParser:
    """A subcommand whose options are generated from ``dataclass_types`` (their defaults are the CLI's)."""
    parser = commands.add_parser(name, dataclass_types=dataclass_types, help=help)
    parser.set_defaults(handler=handler, **cli_defaults)
    parser.config_classes = tuple(dataclass_types)
    parser.deliberate_defaults = dict(cli_defaults)  # e.g. output_dir=runs/<name> instead of TrainingArguments'

    return parser


def resume_field():
    """``--resume [FOLDER]``: a checkpoint folder, or bare / ``last`` for the last checkpoint in --output-dir."""
    return field(default=None, metadata={
        "help": "resume from a checkpoint folder, or the last one in --output-dir (bare --resume or 'last')",
        "nargs": "?", "const": "last"})


#: short spellings kept for the most used TrainingArguments options
SHORT_FLAGS = {"--lr": "learning_rate", "--epochs": "num_train_epochs", "--batch-size": "per_device_train_batch_size",
               "--grad-accum": "gradient_accumulation_steps", "--scheduler": "lr_scheduler_type",
               "--warmup": "warmup_steps"}


def add_short_flags(parser: argparse.ArgumentParser) -> None:
    types = {action.dest: action.type for action in parser._actions}
    for flag, dest in SHORT_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=types.get(dest), default=argparse.SUPPRESS,
                            help=f"same as --{dest}")


def set_threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def bf16_supported() -> bool:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return fast_dtype("cpu") == torch.bfloat16  # native bf16 matmuls: avx512_bf16 / AMX


def precision_overrides(bf16: bool) -> dict[str, Any]:
    """``TrainingArguments`` for the training precision. transformers refuses bf16 without a bf16 GPU unless
    ``use_cpu`` is set, so a bf16 run on a CPU (avx512_bf16 / AMX, where ``--precision auto`` picks it) says so."""
    import torch

    return {"bf16": bf16, **({"use_cpu": True} if bf16 and not torch.cuda.is_available() else {})}


def run_overrides(args: argparse.Namespace, eval_data) -> dict[str, Any]:
    """TrainingArguments that follow from run options: evaluate each epoch when there is eval data (unless an
    eval strategy was chosen), ``--no-progress``."""
    overrides: dict[str, Any] = {}
    if eval_data is not None and args.eval_strategy in ("no", None):
        overrides["eval_strategy"] = "epoch"
    if args.no_progress:
        overrides["disable_tqdm"] = True
    return overrides


def resume_from(args: argparse.Namespace) -> str | None:
    """``--resume`` as ``resume_from_checkpoint``: a folder, the last checkpoint of ``--output-dir``, or None."""
    return last_checkpoint(args.output_dir) if args.resume == "last" else args.resume


def last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(output_dir)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        print(f"no checkpoint in {output_dir}; starting fresh")
    return last


def set_seed(seed: int) -> None:
    """Seeds the RNGs before a model is built, so a new model's initial weights follow ``--seed`` (the Trainer seeds
    only when it starts, after the model exists)."""
    import transformers

    transformers.set_seed(seed)


def save_final(trainer, output_dir: str, summary: dict[str, Any]) -> None:
    """The trained model and ``training_summary.json`` in ``output_dir``, written once however many processes train.

    ``trainer.save_model`` writes from the main process only (with FSDP / DeepSpeed every process takes part in
    gathering the sharded weights first), the main process writes and prints the summary, and every process waits
    until both are on disk. Trackers then finish (``end_training``). A run of several processes ends its process
    there (`end_distributed_process`): everything is written.
    """
    import json

    trainer.save_model(output_dir)
    if trainer.args.should_save:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if trainer.accelerator.num_processes > 1:
        end_distributed_process()


def end_distributed_process() -> None:
    """Ends a process of a multi-process run, its output flushed, without tearing down torch's process group.

    Why: on CPU (gloo, torch 2.13) that teardown can hang or abort after a run that trained and saved. Freeing the DDP
    reducer joins the group's worker thread while holding the GIL, and that worker may still be freeing a finished
    collective's tensors, for which it waits for the GIL (seen as a hang, in ``~ProcessGroupGloo`` joining a worker
    blocked in ``~AsyncAllgatherWork``); at interpreter exit the same work aborts the process (``terminate called
    without an active exception``). Both failed CI's two-process tests now and then.
    """
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class TargetArguments:
    """What every non-Trainer command takes: the target, threads, progress bars."""

    target: str = field(default="smollm2-135m-instruct", metadata=option(
        "target model: asset short name, checkpoint folder or .gguf file"))
    threads: int | None = field(default=None, metadata=option("torch.set_num_threads (default: torch's)"))
    no_progress: bool = field(default=False, metadata=option("hide progress bars"))
