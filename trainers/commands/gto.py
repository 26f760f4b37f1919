"""``hf-treespec train gto``: GTO fine-tuning of a feature drafter (default: the drafter shipped for the target).

Kept in its own module; :mod:`.cli` registers it with :func:`add_gto_parser`. Example (a small CPU run)::

    hf-treespec train prepare --split train --num-conversations 64 --tree-policy none --dtype fp32 \\
        --max-length 512 --output runs/data/gto-train
    hf-treespec train gto --data runs/data/gto-train --output-dir runs/gto --max-steps 100 --lr 5e-5 --warmup 10 \\
        --num-groups 2 --group-size 4 --tree-budget 24 --tree-depth 5

Every ``GTOConfig`` field (``TrainingArguments`` included) is an option with the paper's default; ``--config
run.yaml`` sets any of them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from hf_treespec.api import build_config, AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPES, resolve_dtype_name

from .common import resume_field


@dataclass
class GTORunArguments:
    """What ``hf-treespec train gto`` needs besides ``GTOConfig``."""

    data: list[str] = field(metadata={"help": "folder(s) written by `train prepare` (no trees needed)"})
    eval_data: list[str] | None = field(default=None, metadata={"help": "prepared folder(s) evaluated each epoch "
                                                                         "(rewards, token CE)"})
    target: str = field(default="smollm2-135m-instruct",
                        metadata={"help": "target model: asset short name, checkpoint folder or .gguf file"})
    init: str | None = field(default=None, metadata={
        "help": "drafter to fine-tune (default: the one shipped for --target); a frozen copy is the reference"})
    dtype: str = field(default="fp32", metadata={"help": f"target and drafter dtype (bf16 = mixed-precision training); "
                                                         f"{AUTO_DTYPE_HELP}", "choices": [AUTO_DTYPE, "fp32", "bf16"]})
    resume: str | None = resume_field()
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    no_progress: bool = field(default=False, metadata={"help": "hide progress bars"})


def add_gto_parser(commands) -> argparse.ArgumentParser:
    """Adds the ``gto`` subcommand to ``hf-treespec train``: options generated from ``GTOConfig`` (the paper's
    defaults) and :class:`GTORunArguments`."""
    from .common import add_short_flags, add_config_command
    from ..objectives.gto import GTOConfig

    parser = add_config_command(commands, "gto", [GTOConfig, GTORunArguments], run_gto,
                                help="GTO: fine-tune a drafter on the expected acceptance length of its own trees",
                                output_dir="runs/gto")
    add_short_flags(parser)
    return parser


def run_gto(args: argparse.Namespace) -> int:
    from hf_treespec.api import load_target, shipped_drafter_path, TreeSpecDrafterModel

    from .common import (precision_overrides, resume_from, run_overrides, save_final,
                             set_threads)
    from ..data.prepared import load_prepared
    from ..objectives.gto import GTOConfig, GTOTrainer

    set_threads(args)
    args.dtype = resolve_dtype_name(args.dtype)
    dtype = DTYPES[args.dtype]
    data = load_prepared(args.data)
    eval_data = load_prepared(args.eval_data) if args.eval_data else None
    init = args.init
    if init is None:
        try:
            init = str(shipped_drafter_path(args.target))
        except ValueError as err:
            raise ValueError(f"{err} Pass --init <drafter folder> for this target.") from None
    target, _ = load_target(args.target, dtype=dtype)
    drafter = TreeSpecDrafterModel.from_pretrained(init, dtype=dtype).tie_to_target(target)
    if drafter.config.target_layers != data.config.target_layers:
        raise ValueError(f"--init reads target layers {drafter.config.target_layers}, but --data was prepared with "
                         f"{data.config.target_layers}.")
    training_args = build_config(GTOConfig, args, **precision_overrides(args.dtype == "bf16"),
                                     **run_overrides(args, eval_data))
    trainer = GTOTrainer(drafter, training_args, target_model=target, train_dataset=data, eval_dataset=eval_data)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume_from(args))
    logs = [log for log in trainer.state.log_history if "loss" in log]
    summary = {"objective": "gto", "init": init, "output_dir": args.output_dir, "steps": result.global_step,
               "train_loss": round(result.training_loss, 4), "seconds": round(time.perf_counter() - start, 1),
               "sequences": len(data.dataset), "first_log": logs[0] if logs else {},
               "last_log": logs[-1] if logs else {}}
    save_final(trainer, args.output_dir, summary)
    return 0
