"""``hf-treespec train ...``: data extraction, EAGLE / HASS / TALF training and acceptance evaluation.

``hf_treespec`` never imports this package: the ``hf-treespec`` command finds :func:`add_parser` through the
``hf_treespec.cli`` entry-point group. Subcommands::

    hf-treespec train prepare  --split train --num-conversations 400 --output runs/data/train   # + TALF trees
    hf-treespec train eagle    --data runs/data/train --output-dir runs/eagle                  # warm-up
    hf-treespec train talf     --data runs/data/train --init runs/eagle --output-dir runs/talf
    hf-treespec train evaluate --data runs/data/dev --drafter runs/talf                        # acceptance per depth
    hf-treespec train nde-data --split train --num-prompts 50 --drafter truncated:6 --temperature 1.0 \
        --output runs/nde/data-t1                                                           # NDE selector data
    hf-treespec train nde      --data runs/nde/data-t1 --output-dir runs/nde               # -> tree_selector=
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

#: TALF's tree at preprocessing (salf_talf section 4.1: EAGLE-2 beam, k=4, depth 3)
TALF_TREE = {"tree_topk": 4, "tree_depth": 3}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``train`` and its subcommands to the ``hf-treespec`` parser; each sets ``handler``."""
    parser = subparsers.add_parser("train", help="train TreeSpec feature drafters (EAGLE, HASS, TALF) and the NDE "
                                                 "delay selector",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="train_command", required=True, metavar="STEP")
    _add_prepare(commands)
    for name in ("eagle", "hass", "talf"):
        _add_train(commands, name)
    _add_evaluate(commands)
    _add_nde_data(commands)
    _add_nde(commands)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="target model: asset short name, checkpoint folder or .gguf file")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _layers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ------------------------------------------------------------------------------------------------------ prepare
def _add_prepare(commands) -> None:
    p = commands.add_parser("prepare", help="extract target hidden states (and TALF target trees) to disk",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--split", default="train", choices=["train", "dev"], help="ShareGPT split (assets)")
    source.add_argument("--data-file", default=None,
                        help="your own conversations: .json array or .jsonl of ShareGPT records or message lists")
    p.add_argument("--skip", type=int, default=0, help="skip the first N conversations of the source")
    p.add_argument("--num-conversations", type=int, default=400, help="conversations to use (0 = all)")
    p.add_argument("--output", default=None, help="output folder (default: runs/data/<split>)")
    p.add_argument("--max-length", type=int, default=2048, help="truncate conversations to this many tokens")
    p.add_argument("--target-layers", type=_layers, default=[-1],
                   help="comma list of target layers the drafter reads (-1 = pre-norm last state)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target dtype")
    p.add_argument("--storage-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--chunk-size", type=int, default=32, help="conversations per resumable chunk")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per target forward")
    p.add_argument("--tree-policy", default="eagle2",
                   help="policy the target grows TALF trees with ('none' for EAGLE/HASS-only data; 'chain' for "
                        "evaluation data)")
    p.add_argument("--tree-topk", type=int, default=TALF_TREE["tree_topk"])
    p.add_argument("--tree-depth", type=int, default=TALF_TREE["tree_depth"])
    p.add_argument("--tree-positions", default="64",
                   help="tree roots sampled per conversation, or 'all' (cost: ~expanded nodes target tokens each)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_prepare)


def _tree_params(policy: str, args) -> dict[str, Any]:
    from hf_treespec.policies import POLICIES

    accepted = POLICIES.get(policy).defaults
    wanted = {"tree_topk": args.tree_topk, "tree_depth": args.tree_depth}
    return {key: value for key, value in wanted.items() if key in accepted}


def _conversations(args):
    import itertools

    if args.data_file:
        path = Path(args.data_file)
        if not path.is_file():
            raise FileNotFoundError(f"--data-file {path} does not exist.")
        text = path.read_text(encoding="utf-8")
        records = (json.loads(text) if path.suffix == ".json"
                   else [json.loads(line) for line in text.splitlines() if line.strip()])
        source = iter(records)
    else:
        from hf_treespec.assets import iter_sharegpt

        source = iter_sharegpt(args.split)
    return itertools.islice(source, args.skip, None)


def run_prepare(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.assets import load_target

    from .data import PrepareConfig, load_prepared, prepare_dataset

    _threads(args)
    policy = None if args.tree_policy.lower() == "none" else args.tree_policy
    positions = None if str(args.tree_positions).lower() == "all" else int(args.tree_positions)
    config = PrepareConfig(
        target_layers=args.target_layers, max_length=args.max_length, storage_dtype=args.storage_dtype,
        chunk_size=args.chunk_size, batch_tokens=args.batch_tokens, tree_policy=policy,
        tree_params=_tree_params(policy, args) if policy else {}, tree_positions=positions, seed=args.seed,
        target=args.target,
    )
    output = Path(args.output or f"runs/data/{'custom' if args.data_file else args.split}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model, tokenizer = load_target(args.target, dtype=dtype)
    start = time.perf_counter()
    count = args.num_conversations or None
    prepare_dataset(model, tokenizer, _conversations(args), output, config, num_conversations=count,
                    progress=not args.no_progress)
    data = load_prepared(output)
    summary = {"output": str(output), "conversations": len(data.dataset), "tokens": data.num_tokens,
               "seconds": round(time.perf_counter() - start, 1), "disk_mb": round(_disk_mb(output), 1)}
    print(json.dumps(summary))
    return 0


def _disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


# ------------------------------------------------------------------------------------------------------- train
#: per objective: the defaults its paper trains with (used when the option is not given)
OBJECTIVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "eagle": {"learning_rate": 3e-4, "lr_scheduler_type": "cosine", "warmup_steps": 0.05},
    "hass": {"learning_rate": 3e-4, "lr_scheduler_type": "cosine", "warmup_steps": 0.05},
    "talf": {"learning_rate": 3e-4, "lr_scheduler_type": "cosine", "warmup_steps": 0.05, "adam_beta2": 0.95},
}


def _add_train(commands, name: str) -> None:
    p = commands.add_parser(name, help=f"train a drafter with the {name.upper()} objective",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(p)
    p.add_argument("--data", required=True, help="folder written by `train prepare`")
    p.add_argument("--eval-data", default=None, help="prepared folder evaluated each epoch (eval loss, top-1)")
    p.add_argument("--output-dir", default=f"runs/{name}", help="checkpoints and the final drafter")
    p.add_argument("--init", default=None, help="start from this drafter (e.g. the EAGLE warm-up) instead of new")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="new drafters: LM-head rows, the most frequent target-argmax tokens of --data")
    p.add_argument("--input-mode", default="fc", choices=["fc", "eagle3"], help="new drafters: input layout")
    p.add_argument("--num-layers", type=int, default=1, help="new drafters: decoder layers")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    p.add_argument("--lr", type=float, default=None, help=f"default {OBJECTIVE_DEFAULTS[name]['learning_rate']}")
    p.add_argument("--scheduler", default=None, help="lr schedule (default cosine)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up steps (int) or ratio (< 1); default 0.05")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per device and step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 autocast where supported (CPUs with avx512_bf16, recent GPUs)")
    p.add_argument("--logging-steps", type=int, default=10)
    _add_checkpointing(p)
    if name in ("eagle", "hass"):
        p.add_argument("--ce-weight", type=float, default=0.1)
        p.add_argument("--feature-weight", type=float, default=1.0)
    if name == "hass":
        p.add_argument("--unroll-steps", type=int, default=3)
        p.add_argument("--distill-topk", type=int, default=10)
        p.add_argument("--distill-weight", type=float, default=0.1)
    p.set_defaults(handler=run_train, objective=name)


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _bf16_supported() -> bool:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def build_drafter(args, target, data):
    """The drafter to train: ``--init`` loaded, or a new one sized from the target and the data's token counts."""
    from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel, build_draft_vocab

    if args.init:
        drafter = TreeSpecDrafterModel.from_pretrained(args.init)
        if drafter.config.target_layers != data.config.target_layers:
            raise ValueError(f"--init reads target layers {drafter.config.target_layers}, but --data was prepared "
                             f"with {data.config.target_layers}.")
        return drafter.tie_to_target(target)
    vocab = target.config.get_text_config().vocab_size
    size = min(args.draft_vocab_size, vocab)
    config = TreeSpecDrafterConfig.for_target(
        target.config, target_layers=data.config.target_layers, draft_vocab_size=size, input_mode=args.input_mode,
        num_hidden_layers=args.num_layers, share_target_embeddings=True, share_target_lm_head=True,
    )
    drafter = TreeSpecDrafterModel(config)
    if size < vocab:
        drafter.set_draft_vocab(build_draft_vocab(data.token_counts, size)[0])
    return drafter.tie_to_target(target)


def run_train(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.assets import load_target

    from . import TRAINERS
    from .data import load_prepared

    _threads(args)
    trainer_cls = TRAINERS[args.objective]
    data = load_prepared(args.data)
    eval_data = load_prepared(args.eval_data) if args.eval_data else None
    if args.objective == "talf" and data.config.tree_policy is None:
        raise ValueError(f"{args.data} holds no target trees: prepare it with --tree-policy eagle2 for TALF.")
    target, _ = load_target(args.target or data.config.target, dtype=torch.bfloat16)
    drafter = build_drafter(args, target, data)
    defaults = OBJECTIVE_DEFAULTS[args.objective]
    bf16 = args.precision == "bf16" or (args.precision == "auto" and _bf16_supported())
    options: dict[str, Any] = dict(
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps,
        learning_rate=args.lr if args.lr is not None else defaults["learning_rate"],
        lr_scheduler_type=args.scheduler or defaults["lr_scheduler_type"],
        warmup_steps=args.warmup if args.warmup is not None else defaults["warmup_steps"],
        adam_beta2=defaults.get("adam_beta2", 0.999), weight_decay=args.weight_decay,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_grad_norm=args.max_grad_norm, bf16=bf16,
        use_cpu=not torch.cuda.is_available(), logging_steps=args.logging_steps, report_to="none",
        **_checkpoint_options(args, evaluate=eval_data is not None),
    )
    for name in ("ce_weight", "feature_weight", "unroll_steps", "distill_topk", "distill_weight"):
        if hasattr(args, name):
            options[name] = getattr(args, name)
    training_args = trainer_cls.config_class(**options)
    trainer = trainer_cls(drafter, training_args, target_model=target, train_dataset=data, eval_dataset=eval_data)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=_resume_from(args))
    seconds = time.perf_counter() - start
    drafter.save_pretrained(args.output_dir)
    summary = {"objective": args.objective, "output_dir": args.output_dir, "steps": result.global_step,
               "train_loss": round(result.training_loss, 4), "seconds": round(seconds, 1),
               "sequences": len(data.dataset), "tokens": data.num_tokens, "bf16": bf16,
               "last_log": next((log for log in reversed(trainer.state.log_history) if "loss" in log), {})}
    (Path(args.output_dir) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


def _add_checkpointing(parser: argparse.ArgumentParser) -> None:
    """Checkpoint / resume / seed flags every Trainer-backed subcommand takes (read by :func:`_checkpoint_options`)."""
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0 = every epoch)")
    parser.add_argument("--save-total-limit", type=int, default=2)
    parser.add_argument("--resume", nargs="?", const="last", default=None,
                        help="resume from a checkpoint folder, or the last one in --output-dir")
    parser.add_argument("--seed", type=int, default=42)


def _checkpoint_options(args: argparse.Namespace, evaluate: bool) -> dict[str, Any]:
    """The ``TrainingArguments`` that :func:`_add_checkpointing`'s flags, ``--no-progress`` and eval data decide."""
    return dict(
        save_strategy="steps" if args.save_steps else "epoch", save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit, eval_strategy="epoch" if evaluate else "no", seed=args.seed,
        disable_tqdm=args.no_progress, dataloader_num_workers=0,
    )


def _resume_from(args: argparse.Namespace) -> str | None:
    """``--resume`` as ``resume_from_checkpoint``: a folder, the last checkpoint of ``--output-dir``, or None."""
    return _last_checkpoint(args.output_dir) if args.resume == "last" else args.resume


def _last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(output_dir)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        print(f"no checkpoint in {output_dir}; starting fresh")
    return last


# ---------------------------------------------------------------------------------------------------- evaluate
def _add_evaluate(commands) -> None:
    p = commands.add_parser("evaluate", help="held-out top-1 acceptance per depth (data prepared with --tree-policy "
                                             "chain)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(p)
    p.add_argument("--data", required=True, help="prepared folder with chain trees (e.g. ShareGPT dev)")
    p.add_argument("--drafter", required=True, action="append", help="drafter folder (repeatable)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--output", default=None, help="write the results as JSON here too")
    p.set_defaults(handler=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.assets import load_target
    from hf_treespec.drafters import TreeSpecDrafterModel

    from .data import load_prepared
    from .evaluation import acceptance_by_depth
    from .losses import TargetHead

    _threads(args)
    data = load_prepared(args.data)
    target, _ = load_target(args.target, dtype=torch.bfloat16)
    head = TargetHead.from_target(target)
    results = {}
    for folder in args.drafter:
        drafter = TreeSpecDrafterModel.from_pretrained(folder).tie_to_target(target)
        start = time.perf_counter()
        results[folder] = acceptance_by_depth(drafter, data, head, args.batch_size, progress=not args.no_progress)
        results[folder]["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({folder: results[folder]}))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0


# ------------------------------------------------------------------------------------------------------- NDE
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _add_nde_data(commands) -> None:
    p = commands.add_parser("nde-data", help="offline block-efficiency / step-time estimates per (k, l1, l2) action "
                                             "for the NDE delay selector", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--split", default="train", choices=["train", "dev"], help="ShareGPT split (first user turns)")
    source.add_argument("--questions", default=None, help="an MT-bench / Spec-Bench style question.jsonl instead")
    p.add_argument("--skip", type=int, default=0, help="skip the first N prompts of the source")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-prompt-length", type=int, default=1536, help="skip prompts longer than this (tokens)")
    p.add_argument("--drafter", required=True,
                   help="truncated:K (target's first K layers), a feature drafter folder or a causal-LM checkpoint")
    p.add_argument("--output", default=None, help="output folder (default: runs/nde/data-<split>-T<temperature>)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target / drafter dtype")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (verifier greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None, help="default off")
    p.add_argument("--verifier", default=None, help="top-down verifier to estimate for (default: specinfer when "
                                                    "sampling, greedy at temperature 0); specinfer, naivetree, nss")
    p.add_argument("--max-new-tokens", type=int, default=256, help="trajectory length per prompt")
    p.add_argument("--root-every", type=int, default=16, help="a root every N generated tokens")
    p.add_argument("--num-samples", type=int, default=8, help="delayed trees per root (drafting-noise average)")
    p.add_argument("--trees-per-forward", type=int, default=4, help="samples merged into one target forward")
    # trees of at most 3 + 4 x 4 = 19 drafts: on CPU a target forward grows with the tree (DESIGN.md calibration)
    p.add_argument("--paths", type=_ints, default=[1, 2, 4], help="k values")
    p.add_argument("--trunks", type=_ints, default=[0, 1, 2, 3], help="l1 values")
    p.add_argument("--branches", type=_ints, default=[1, 2, 3, 4], help="l2 values")
    p.add_argument("--chunk-size", type=int, default=5, help="prompts per resumable chunk")
    p.add_argument("--latency-repeats", type=int, default=3, help="repeats per microbenchmark point")
    p.add_argument("--latency-contexts", type=_ints, default=[64, 256, 768], help="context lengths benchmarked")
    p.add_argument("--step-overhead", type=float, default=0.0,
                   help="seconds per step outside the forwards (verification, bookkeeping) added to every action")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_nde_data)


def _nde_prompts(args, tokenizer) -> list:
    from hf_treespec.assets import load_questions, sharegpt_prompts
    from hf_treespec.benchmark.runner import build_prompt

    limit = args.skip + args.num_prompts
    questions = (load_questions(args.questions, limit) if args.questions else sharegpt_prompts(args.split, limit))
    prompts = [build_prompt(tokenizer, q) for q in questions[args.skip :]]
    return [ids for ids in prompts if ids.shape[1] <= args.max_prompt_length]


def run_nde_data(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.assets import load_target
    from hf_treespec.benchmark.runner import load_drafter
    from hf_treespec.drafters import TreeSpecDrafterModel

    from .latency import measure_latency
    from .nde_data import NDEDataConfig, generate_nde_data, load_nde_data

    _threads(args)
    verifier = args.verifier or ("greedy" if args.temperature == 0 else "specinfer")
    config = NDEDataConfig(
        paths=args.paths, trunks=args.trunks, branches=args.branches, verifier=verifier,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
        root_every=args.root_every, num_samples=args.num_samples, trees_per_forward=args.trees_per_forward,
        chunk_size=args.chunk_size, seed=args.seed, target=args.target, drafter=args.drafter,
    )
    tag = "questions" if args.questions else args.split
    output = Path(args.output or f"runs/nde/data-{tag}-T{args.temperature:g}")
    model, tokenizer = load_target(args.target, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    drafter = load_drafter(args.drafter, model, args.dtype)
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


def _add_nde(commands) -> None:
    p = commands.add_parser("nde", help="train the NDE delay selector (tree_policy='nde') on nde-data",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--data", required=True, action="append", help="nde-data folder (repeatable: e.g. temperatures)")
    p.add_argument("--eval-data", default=None, action="append", help="held-out nde-data folder (repeatable)")
    p.add_argument("--output-dir", default="runs/nde", help="checkpoints and the final selector folder")
    p.add_argument("--epochs", type=float, default=20.0)
    p.add_argument("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64, help="roots per step")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--penalty-weight", type=float, default=1.0, help="lambda of the regression penalty")
    p.add_argument("--penalty-fraction", type=float, default=0.1, help="rho: worst share of a minibatch penalised")
    p.add_argument("--baseline-action", default=None,
                   help="static baseline k,l1,l2 (default: best static action per sampling setting)")
    p.add_argument("--shared-dim", type=int, default=64, help="d, projection width of the hidden-state input")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--no-hidden", action="store_true", help="scalar features only (no target hidden state)")
    p.add_argument("--latency-features", action="store_true",
                   help="also feed the measured draft / target latencies (useful when --data mixes machines)")
    p.add_argument("--logging-steps", type=int, default=20)
    _add_checkpointing(p)
    p.set_defaults(handler=run_nde)


def run_nde(args: argparse.Namespace) -> int:
    from .nde import NDEConfig, NDETrainer, build_selector
    from .nde_data import load_nde_data

    _threads(args)
    data = load_nde_data(args.data)
    eval_data = load_nde_data(args.eval_data) if args.eval_data else None
    selector = build_selector(data, shared_dim=args.shared_dim, dropout=args.dropout, use_hidden=not args.no_hidden,
                              latency_features=args.latency_features)
    training_args = NDEConfig(
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, weight_decay=args.weight_decay,
        penalty_weight=args.penalty_weight, penalty_fraction=args.penalty_fraction,
        baseline_action=args.baseline_action, logging_steps=args.logging_steps, use_cpu=True,
        **_checkpoint_options(args, evaluate=eval_data is not None),
    )
    trainer = NDETrainer(selector, training_args, train_dataset=data, eval_dataset=eval_data)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=_resume_from(args))
    trainer.save_model(args.output_dir)
    summary = {"output_dir": args.output_dir, "steps": result.global_step, "roots": len(data),
               "train_loss": round(result.training_loss, 4), "seconds": round(time.perf_counter() - start, 1),
               "baseline_actions": selector.config.baseline_actions}
    if eval_data is not None:
        summary["eval"] = {k: round(v, 4) for k, v in trainer.evaluate().items() if isinstance(v, float)}
    (Path(args.output_dir) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0
