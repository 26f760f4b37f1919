"""``hf-treespec train prepare``: target hidden states (and TALF target trees) of conversations, to disk."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_treespec.api import (
    HelpFormatter, add_options, build_config, comma_list, option, AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES,
    DTYPES, resolve_dtype_name,
)

from .common import TargetArguments, set_threads
from ..data.regenerate import CHUNK_PREFIX as REGEN_CHUNK_PREFIX

#: TALF's tree at preprocessing (salf_talf section 4.1: EAGLE-2 beam, k=4, depth 3)
TALF_TREE = {"tree_topk": 4, "tree_depth": 3}


@dataclass
class PrepareArguments:
    """What ``hf-treespec train prepare`` needs besides :class:`~.data.PrepareConfig`: the source, the output, and
    the target layers and tree parameters the config is built from."""

    split: str = field(default="train", metadata=option(
        "ShareGPT split (assets)", choices=("train", "dev"), group="source"))
    data_file: str | None = field(default=None, metadata=option(
        "your own conversations: .json array or .jsonl of ShareGPT records or message lists, or a `train regenerate` "
        "output folder (its token ids are used as they are)", group="source"))
    skip: int = field(default=0, metadata=option("skip the first N conversations of the source"))
    num_conversations: int = field(default=400, metadata=option("conversations to use (0 = all)"))
    output: str | None = field(default=None, metadata=option("output folder (default: runs/data/<split>)"))
    input_mode: str = field(default="fc", metadata=option(
        "fc: the pre-norm last state (EAGLE-1); eagle3: EAGLE-3's low / mid / high target layers",
        choices=("fc", "eagle3")))
    target_layers: list[int] | None = field(default=None, metadata=option(
        "comma list of target layers the drafter reads (-1 = pre-norm last state); default: from --input-mode",
        parse=comma_list(int)))
    dtype: str = field(default=AUTO_DTYPE, metadata=option(f"target dtype; {AUTO_DTYPE_HELP}", choices=DTYPE_CHOICES))
    tree_topk: int = field(default=TALF_TREE["tree_topk"], metadata=option("children per expanded tree node"))
    tree_depth: int = field(default=TALF_TREE["tree_depth"], metadata=option("tree depth"))


#: where ``prepare`` departs from PrepareConfig's defaults: TALF trees by default (the config's default is none)
PREPARE_DEFAULTS = {"tree_policy": "eagle2"}


def add_prepare_parser(commands) -> None:
    from ..data.prepared import PrepareConfig

    p = commands.add_parser("prepare", help="extract target hidden states (and TALF target trees) to disk",
                            formatter_class=HelpFormatter)
    add_options(p, TargetArguments, PrepareArguments, PrepareConfig, defaults=PREPARE_DEFAULTS)
    p.set_defaults(handler=run_prepare)


def _tree_params(policy: str, args) -> dict[str, Any]:
    from hf_treespec.api import POLICIES

    accepted = POLICIES.get(policy).defaults
    wanted = {"tree_topk": args.tree_topk, "tree_depth": args.tree_depth}
    return {key: value for key, value in wanted.items() if key in accepted}


def _conversations(args):
    import itertools

    if args.data_file:
        path = Path(args.data_file)
        if path.is_dir() or (path.name.startswith(REGEN_CHUNK_PREFIX) and path.suffix == ".jsonl"):
            # `train regenerate` output: chunk files are validated as they are read
            from ..data.regenerate import iter_regenerated

            return itertools.islice(iter_regenerated(path), args.skip, None)
        if not path.is_file():
            raise FileNotFoundError(f"--data-file {path} does not exist.")
        text = path.read_text(encoding="utf-8")
        records = (json.loads(text) if path.suffix == ".json"
                   else [json.loads(line) for line in text.splitlines() if line.strip()])
        source = iter(records)
    else:
        from hf_treespec.api import iter_sharegpt

        source = iter_sharegpt(args.split)
    return itertools.islice(source, args.skip, None)


def run_prepare(args: argparse.Namespace) -> int:
    import torch

    from hf_treespec.api import load_target

    from ..data.prepared import PrepareConfig, load_prepared, prepare_dataset

    from ..objectives.ttt import resolve_target_layers

    set_threads(args)
    policy = args.tree_policy
    model, tokenizer = load_target(args.target, dtype=DTYPES[resolve_dtype_name(args.dtype)])
    layers = resolve_target_layers(args.input_mode, args.target_layers,
                                   model.config.get_text_config().num_hidden_layers)
    config = build_config(PrepareConfig, args, target_layers=layers, target=args.target,
                          tree_params=_tree_params(policy, args) if policy else {})
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
