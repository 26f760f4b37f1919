"""``hf-treespec train prepare``: target hidden states (and TALF target trees) of conversations, to disk."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hf_treespec.hardware import AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES, DTYPES, resolve_dtype_name

from .cli_common import add_common_options, int_list, set_threads
from .regenerate import CHUNK_PREFIX as REGEN_CHUNK_PREFIX

#: TALF's tree at preprocessing (salf_talf section 4.1: EAGLE-2 beam, k=4, depth 3)
TALF_TREE = {"tree_topk": 4, "tree_depth": 3}


def add_prepare_parser(commands) -> None:
    p = commands.add_parser("prepare", help="extract target hidden states (and TALF target trees) to disk",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_options(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--split", default="train", choices=["train", "dev"], help="ShareGPT split (assets)")
    source.add_argument("--data-file", default=None,
                        help="your own conversations: .json array or .jsonl of ShareGPT records or message lists, "
                             "or a `train regenerate` output folder (its token ids are used as they are)")
    p.add_argument("--skip", type=int, default=0, help="skip the first N conversations of the source")
    p.add_argument("--num-conversations", type=int, default=400, help="conversations to use (0 = all)")
    p.add_argument("--output", default=None, help="output folder (default: runs/data/<split>)")
    p.add_argument("--max-length", type=int, default=2048, help="truncate conversations to this many tokens")
    p.add_argument("--target-layers", type=int_list, default=None,
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
