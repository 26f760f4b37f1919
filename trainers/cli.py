"""``hf-treespec train ...``: self-distilled data, extraction, EAGLE / HASS / TALF / TTT training, acceptance.

``hf_treespec`` never imports this package: the ``hf-treespec`` command finds :func:`add_parser` through the
``hf_treespec.cli`` entry-point group. Subcommands::

    hf-treespec train regenerate --num-prompts 1000 --temperature 0,0.8 --output runs/regen/train  # self-distilled
    hf-treespec train prepare  --split train --num-conversations 400 --output runs/data/train   # + TALF trees
    hf-treespec train prepare  --data-file runs/regen/train --input-mode eagle3 --output runs/data/train-e3
    hf-treespec train eagle    --data runs/data/train --output-dir runs/eagle                  # warm-up
    hf-treespec train talf     --data runs/data/train --init runs/eagle --output-dir runs/talf
    hf-treespec train ttt      --data runs/data/train-e3 --output-dir runs/ttt   # EAGLE-3 TTT (+ TALF trees)
    hf-treespec train evaluate --data runs/data/dev --drafter runs/talf                        # acceptance per depth
    hf-treespec train gto      --data runs/data/train --output-dir runs/gto     # GTO from the shipped drafter
    hf-treespec train nde-data --split train --num-prompts 50 --drafter truncated:6 --temperature 1.0 \
        --output runs/nde/data-t1                                                           # NDE selector data
    hf-treespec train nde      --data runs/nde/data-t1 --output-dir runs/nde               # -> tree_selector=
    hf-treespec train c2t-data --num-prompts 150 --output runs/c2t/data                  # labelled EAGLE-2 trees
    hf-treespec train c2t      --data runs/c2t/data --output-dir runs/c2t                # -> c2t_classifier=
    hf-treespec train static-shape --data runs/c2t/data --budget 60                      # -> tree_shape=

The options of ``eagle`` / ``hass`` / ``talf`` / ``ttt`` / ``gto`` / ``nde`` / ``c2t`` are generated from their config
dataclasses (every ``TrainingArguments`` field included), whose defaults are the only ones; every subcommand also takes
``--config run.yaml`` (option names as keys; flags given on the command line win). A new subcommand is one function
decorated with ``@subcommand("name")``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hf_treespec.hardware import AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES, DTYPES, resolve_dtype_name

from .cli_common import (
    ConfigParser, add_config_command, add_short_flags, bf16_supported, config_from_args, precision_overrides,
    resume_field, resume_from, run_overrides, save_final, set_seed, set_threads,
)
from .regenerate import CHUNK_PREFIX as REGEN_CHUNK_PREFIX
from .regenerate import add_regenerate_parser

#: TALF's tree at preprocessing (salf_talf section 4.1: EAGLE-2 beam, k=4, depth 3)
TALF_TREE = {"tree_topk": 4, "tree_depth": 3}
#: LM-head rows of a new drafter (EAGLE-3's reduced draft vocabulary; it holds ~94% of SmolLM2's own greedy answer tokens)
DRAFT_VOCAB_SIZE = 8192


#: subcommand name -> function adding it to the ``train`` subparsers (registration order = help order)
SUBCOMMANDS: dict[str, Callable[[Any], None]] = {}


def subcommand(name: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Registers ``add(commands)`` as the builder of ``hf-treespec train <name>``: adding a subcommand is one
    decorated function (with :func:`add_config_command` when its options are config dataclasses)."""
    def register(add: Callable[[Any], None]) -> Callable[[Any], None]:
        if name in SUBCOMMANDS:
            raise ValueError(f"train subcommand {name!r} is registered twice.")
        SUBCOMMANDS[name] = add
        return add
    return register


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``train`` and its registered subcommands to the ``hf-treespec`` parser; each sets ``handler``."""
    parser = subparsers.add_parser("train", help="train TreeSpec feature drafters (EAGLE, HASS, TALF, EAGLE-3 TTT, GTO), the NDE "
                                                 "delay selector and the C2T classifier",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="train_command", required=True, metavar="STEP", parser_class=ConfigParser)
    for add in SUBCOMMANDS.values():
        add(commands)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="target model: asset short name, checkpoint folder or .gguf file")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _layers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ------------------------------------------------------------------------------------------------------ prepare
@subcommand("prepare")
def _add_prepare(commands) -> None:
    p = commands.add_parser("prepare", help="extract target hidden states (and TALF target trees) to disk",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--split", default="train", choices=["train", "dev"], help="ShareGPT split (assets)")
    source.add_argument("--data-file", default=None,
                        help="your own conversations: .json array or .jsonl of ShareGPT records or message lists, "
                             "or a `train regenerate` output folder (its token ids are used as they are)")
    p.add_argument("--skip", type=int, default=0, help="skip the first N conversations of the source")
    p.add_argument("--num-conversations", type=int, default=400, help="conversations to use (0 = all)")
    p.add_argument("--output", default=None, help="output folder (default: runs/data/<split>)")
    p.add_argument("--max-length", type=int, default=2048, help="truncate conversations to this many tokens")
    p.add_argument("--target-layers", type=_layers, default=None,
                   help="comma list of target layers the drafter reads (-1 = pre-norm last state); default: "
                        "from --input-mode")
    p.add_argument("--input-mode", default="fc", choices=["fc", "eagle3"],
                   help="fc: the pre-norm last state (EAGLE-1); eagle3: EAGLE-3's low / mid / high target layers")
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES,
                   help=f"target dtype; {AUTO_DTYPE_HELP}")
    p.add_argument("--storage-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--chunk-size", type=int, default=64, help="conversations per resumable chunk")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per target forward")
    p.add_argument("--tree-policy", default="eagle2",
                   help="policy the target grows TALF trees with ('none' for EAGLE/HASS-only data; 'chain' for "
                        "evaluation data)")
    p.add_argument("--tree-topk", type=int, default=TALF_TREE["tree_topk"])
    p.add_argument("--tree-depth", type=int, default=TALF_TREE["tree_depth"])
    p.add_argument("--tree-positions", default=64,
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
        if path.is_dir() or (path.name.startswith(REGEN_CHUNK_PREFIX) and path.suffix == ".jsonl"):
            # `train regenerate` output: chunk files are validated as they are read
            from .regenerate import iter_regenerated

            return itertools.islice(iter_regenerated(path), args.skip, None)
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

    from .ttt import resolve_target_layers

    set_threads(args)
    policy = None if args.tree_policy.lower() == "none" else args.tree_policy
    positions = None if str(args.tree_positions).lower() == "all" else int(args.tree_positions)
    model, tokenizer = load_target(args.target, dtype=DTYPES[resolve_dtype_name(args.dtype)])
    layers = resolve_target_layers(args.input_mode, args.target_layers,
                                   model.config.get_text_config().num_hidden_layers)
    config = PrepareConfig(
        target_layers=layers, max_length=args.max_length, storage_dtype=args.storage_dtype,
        chunk_size=args.chunk_size, batch_tokens=args.batch_tokens, tree_policy=policy,
        tree_params=_tree_params(policy, args) if policy else {}, tree_positions=positions, seed=args.seed,
        target=args.target,
    )
    output = Path(args.output or f"runs/data/{'custom' if args.data_file else args.split}")
    if torch.cuda.is_available():
        model.to("cuda")  # extraction is a no-grad target pass: minutes on a GPU
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
    num_layers: int | None = field(default=None, metadata={"help": "new drafters: decoder layers (default 1)"})
    precision: str = field(default="auto", metadata={
        "help": "auto: bf16 autocast where supported (CPUs with avx512_bf16, recent GPUs)",
        "choices": ["auto", "bf16", "fp32"]})
    resume: str | None = resume_field()
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    no_progress: bool = field(default=False, metadata={"help": "hide progress bars"})


def _trainer_command(name: str) -> Callable[[Any], None]:
    def add(commands) -> None:
        from . import TRAINERS

        parser = add_config_command(commands, name, [TRAINERS[name].config_class, DrafterRunArguments], run_train,
                                    help=f"train a drafter with the {name.upper()} objective", objective=name,
                                    output_dir=f"runs/{name}")
        add_short_flags(parser)
    return add


for _name in ("eagle", "hass", "talf", "ttt"):
    subcommand(_name)(_trainer_command(_name))


def _check_init_shape(args, config) -> None:
    """The shape flags only size new drafters: with ``--init`` they must agree with the loaded one, not be ignored."""
    given = {"--draft-vocab-size": (args.draft_vocab_size, config.draft_vocab_size),
             "--num-layers": (args.num_layers, config.num_hidden_layers),
             "--input-mode": (None if args.input_mode == "auto" else args.input_mode, config.input_mode)}
    clashes = [f"{flag} {wanted} (it has {has})" for flag, (wanted, has) in given.items()
               if wanted is not None and wanted != has]
    if clashes:
        raise ValueError(f"--init {args.init} is a trained drafter, but {', '.join(clashes)} asks for another shape: "
                         "these flags size new drafters only; drop them to train on from --init.")


def build_drafter(args, target, data):
    """The drafter to train: ``--init`` loaded, or a new one sized from the target and the data's token counts."""
    from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel, build_draft_vocab

    if args.init:
        drafter = TreeSpecDrafterModel.from_pretrained(args.init)
        if drafter.config.target_layers != data.config.target_layers:
            raise ValueError(f"--init reads target layers {drafter.config.target_layers}, but --data was prepared "
                             f"with {data.config.target_layers}.")
        _check_init_shape(args, drafter.config)
        return drafter.tie_to_target(target)
    vocab = target.config.get_text_config().vocab_size
    size = min(DRAFT_VOCAB_SIZE if args.draft_vocab_size is None else args.draft_vocab_size, vocab)
    from .ttt import infer_input_mode

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

    from hf_treespec.assets import load_target

    from . import TRAINERS
    from .data import load_prepared

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
    training_args = config_from_args(trainer_cls.config_class, args, **precision_overrides(bf16),
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
@subcommand("evaluate")
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


# ------------------------------------------------------------------------------------------------------- NDE
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@subcommand("nde-data")
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
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES,
                   help=f"target / drafter dtype; {AUTO_DTYPE_HELP}")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (verifier greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None, help="default off")
    p.add_argument("--verifier", default=None, help="top-down verifier to estimate for (default: specinfer when "
                                                    "sampling, greedy at temperature 0); specinfer, naivetree, nss")
    p.add_argument("--max-new-tokens", type=int, default=256, help="trajectory length per prompt")
    p.add_argument("--root-every", type=int, default=16, help="a root every N generated tokens")
    p.add_argument("--num-samples", type=int, default=8, help="delayed trees per root (drafting-noise average)")
    p.add_argument("--trees-per-forward", type=int, default=4, help="samples merged into one target forward")
    # trees of at most 3 + 4 x 4 = 19 drafts: on CPU a target forward grows with the tree
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
    verifier = args.verifier or ("greedy" if args.temperature == 0 else "specinfer")
    config = NDEDataConfig(
        paths=args.paths, trunks=args.trunks, branches=args.branches, verifier=verifier,
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
    resume: str | None = resume_field()
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    no_progress: bool = field(default=False, metadata={"help": "hide progress bars"})


@subcommand("nde")
def _add_nde(commands) -> None:
    from .nde import NDEConfig

    parser = add_config_command(commands, "nde", [NDEConfig, NDERunArguments], run_nde,
                                help="train the NDE delay selector (tree_policy='nde') on nde-data",
                                output_dir="runs/nde")
    add_short_flags(parser)


def run_nde(args: argparse.Namespace) -> int:
    from .nde import NDEConfig, NDETrainer, build_selector
    from .nde_data import load_nde_data

    set_threads(args)
    data = load_nde_data(args.data)
    eval_data = load_nde_data(args.eval_data) if args.eval_data else None
    selector = build_selector(data, shared_dim=args.shared_dim, dropout=args.dropout, use_hidden=not args.no_hidden,
                              latency_features=args.latency_features)
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


# ------------------------------------------------------------------------------------------------------- export
@subcommand("export-eagle3")
def _add_export(commands) -> None:
    p = commands.add_parser("export-eagle3", help="write a TreeSpecDrafterModel (input_mode eagle3) in the EAGLE-3 "
                                                  "layout (a feature norm as norm_before_fc)")
    p.add_argument("--drafter", required=True, help="TreeSpecDrafterModel folder")
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="its target (asset short name, checkpoint folder or .gguf): a shared LM head is written out")
    p.add_argument("--output", required=True, help="folder for config.json + model.safetensors")
    p.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    import torch

    from transformers import AutoModelForCausalLM

    from hf_treespec.assets import TARGETS, load_target
    from hf_treespec.drafters import TreeSpecDrafterModel
    from hf_treespec.drafters.eagle_io import to_eagle3

    if args.target in TARGETS or args.target.lower().endswith(".gguf"):
        target, _ = load_target(args.target, dtype=torch.float32)
    else:  # a checkpoint folder or Hub id: only the weights are needed
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    drafter = TreeSpecDrafterModel.from_pretrained(args.drafter).tie_to_target(target)
    folder = to_eagle3(drafter, args.output, target_num_layers=target.config.get_text_config().num_hidden_layers)
    print(json.dumps({"output": str(folder), "files": sorted(p.name for p in folder.iterdir())}))
    return 0


@subcommand("regenerate")
def _add_regenerate(commands) -> None:
    add_regenerate_parser(commands)  # self-distilled data: the parser lives in .regenerate


@subcommand("gto")
def _add_gto(commands) -> None:
    from .gto_cli import add_gto_parser  # GTO keeps its parser in its own module

    add_gto_parser(commands)


@subcommand("c2t")
def _add_c2t(commands) -> None:
    from .c2t_cli import add_c2t_commands  # c2t-data, c2t and static-shape

    add_c2t_commands(commands, _common, set_threads)
