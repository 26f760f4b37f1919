"""``hf-treespec train gto``: GTO fine-tuning of a feature drafter (default: the drafter shipped for the target).

Kept in its own module; :mod:`.cli` registers it with :func:`add_gto_parser`. Example (a small CPU run)::

    hf-treespec train prepare --split train --num-conversations 64 --tree-policy none --dtype fp32 \\
        --max-length 512 --output runs/data/gto-train
    hf-treespec train gto --data runs/data/gto-train --output-dir runs/gto --max-steps 100 --lr 5e-5 --warmup 10 \\
        --num-groups 2 --group-size 4 --tree-budget 24 --tree-depth 5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_gto_parser(commands) -> argparse.ArgumentParser:
    """Adds the ``gto`` subcommand to ``hf-treespec train``."""
    from .gto import REWARD_AGGREGATIONS, GTOConfig

    defaults = GTOConfig.__dataclass_fields__
    p = commands.add_parser("gto", help="GTO: fine-tune a drafter on the expected acceptance length of its own trees",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="target model: asset short name, checkpoint folder or .gguf file")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--data", required=True, help="folder written by `train prepare` (no trees needed)")
    p.add_argument("--eval-data", default=None, help="prepared folder evaluated each epoch (rewards, token CE)")
    p.add_argument("--init", default=None, help="drafter to fine-tune (default: the one shipped for --target); a "
                                                "frozen copy is the reference")
    p.add_argument("--output-dir", default="runs/gto", help="checkpoints and the final drafter")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="target and drafter dtype")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    p.add_argument("--lr", type=float, default=defaults["learning_rate"].default)
    p.add_argument("--warmup", type=float, default=defaults["warmup_steps"].default,
                   help="linear warm-up steps (int) or ratio (< 1)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per device and micro-batch")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=defaults["max_grad_norm"].default)
    p.add_argument("--logging-steps", type=int, default=5)
    for name in ("eta", "num_groups", "group_size", "omega", "token_loss_weight", "clip_epsilon", "tree_topk",
                 "tree_budget", "tree_depth", "reward_temperature", "target_chunk_tokens"):
        spec = defaults[name]
        p.add_argument("--" + name.replace("_", "-"), type=type(spec.default), default=spec.default,
                       help=spec.metadata.get("help"))
    p.add_argument("--reward-aggregation", default="logsumexp", choices=sorted(REWARD_AGGREGATIONS))
    p.add_argument("--no-debias", action="store_true", help="ablation: no reference-tree debiasing of the reward")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0 = every epoch)")
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--resume", nargs="?", const="last", default=None,
                   help="resume from a checkpoint folder, or the last one in --output-dir")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(handler=run_gto)
    return p


def run_gto(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.assets import load_target, shipped_drafter_path
    from hf_treespec.drafters import TreeSpecDrafterModel

    from .data import load_prepared
    from .gto import GTOConfig, GTOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
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
    training_args = GTOConfig(
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.lr,
        warmup_steps=int(args.warmup) if args.warmup >= 1 else args.warmup, max_grad_norm=args.max_grad_norm,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, logging_steps=args.logging_steps, report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=args.dtype == "bf16",
        save_strategy="steps" if args.save_steps else "epoch", save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit, eval_strategy="epoch" if eval_data is not None else "no",
        seed=args.seed, disable_tqdm=args.no_progress, dataloader_num_workers=0,
        eta=args.eta, num_groups=args.num_groups, group_size=args.group_size, omega=args.omega,
        token_loss_weight=args.token_loss_weight, clip_epsilon=args.clip_epsilon, tree_topk=args.tree_topk,
        tree_budget=args.tree_budget, tree_depth=args.tree_depth, reward_aggregation=args.reward_aggregation,
        debias=not args.no_debias, reward_temperature=args.reward_temperature,
        target_chunk_tokens=args.target_chunk_tokens,
    )
    trainer = GTOTrainer(drafter, training_args, target_model=target, train_dataset=data, eval_dataset=eval_data)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=_resume_from(args))
    drafter.save_pretrained(args.output_dir)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    summary = {"objective": "gto", "init": init, "output_dir": args.output_dir, "steps": result.global_step,
               "train_loss": round(result.training_loss, 4), "seconds": round(time.perf_counter() - start, 1),
               "sequences": len(data.dataset), "first_log": logs[0] if logs else {},
               "last_log": logs[-1] if logs else {}}
    (Path(args.output_dir) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


def _resume_from(args: argparse.Namespace) -> str | None:
    if args.resume != "last":
        return args.resume
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(args.output_dir)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        print(f"no checkpoint in {args.output_dir}; starting fresh")
    return last
