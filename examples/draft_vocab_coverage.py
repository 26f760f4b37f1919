"""How much of the target's own output a reduced draft vocabulary can ever predict.

A drafter with a reduced draft vocabulary (``--draft-vocab-size``, EAGLE-3's ``d2t`` / ``t2d`` maps) cannot propose a
token outside it, so such a token ends the accepted run whatever the drafter learned. This measures the share of answer
tokens inside the vocabulary of each ``--drafter`` and inside the ``--sizes`` most frequent tokens of prepared data
(what ``train eagle|talf --draft-vocab-size K`` would build from the same ``--counts``), per sampling temperature of
``train regenerate`` answers; use answers the counts did not come from (``--skip``) for a held-out figure.

    python examples/draft_vocab_coverage.py --answers runs/regen --skip 1024 --counts runs/data-train runs/data-regen \\
        --drafter runs/talf --sizes 8192 16384 32768
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from hf_treespec.drafters import build_draft_vocab
from hf_treespec.trainers.data.prepared import load_prepared
from hf_treespec.trainers.data.regenerate import iter_regenerated


def answer_ids(folder: str, skip: int) -> dict[float, torch.Tensor]:
    """temperature -> every output token id of the folder's answers after the first ``skip``."""
    by_temperature: dict[float, list[torch.Tensor]] = defaultdict(list)
    for record in itertools.islice(iter_regenerated(folder), skip, None):
        by_temperature[float(record["temperature"])].append(torch.as_tensor(record["output_ids"], dtype=torch.long))
    if not by_temperature:
        raise SystemExit(f"{folder} holds no answers after the first {skip}.")
    return {t: torch.cat(ids) for t, ids in sorted(by_temperature.items())}


def drafter_mask(folder: str) -> torch.Tensor:
    """The drafter's ``t2d`` (True for target ids in its draft vocabulary), read from its weights file."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise SystemExit(f"{path} not found: --drafter takes a drafter folder written by save_pretrained.")
    weights = load_file(str(path))
    if "t2d" not in weights:
        raise SystemExit(f"{path} has no t2d map: a drafter with the full vocabulary covers every token.")
    return weights["t2d"].bool()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", required=True, help="a `train regenerate` folder (or one chunk file)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first N answers (e.g. those trained on)")
    parser.add_argument("--counts", nargs="+", default=[], help="`train prepare` folders whose token counts rank K")
    parser.add_argument("--drafter", action="append", default=[], help="drafter folder (repeat for several)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768])
    args = parser.parse_args()

    ids = answer_ids(args.answers, args.skip)
    masks = {f"drafter {folder}": drafter_mask(folder) for folder in args.drafter}
    if args.counts:
        counts = load_prepared(args.counts).token_counts
        masks.update({f"top {k:,} of --counts": build_draft_vocab(counts, k)[1] for k in args.sizes})
    if not masks:
        raise SystemExit("nothing to measure: give --drafter and / or --counts.")
    print("| vocabulary | " + " | ".join(f"T {t:g} ({v.numel():,} tokens)" for t, v in ids.items()) + " |")
    print("|---|" + "---:|" * len(ids))
    for name, mask in masks.items():
        print(f"| {name} | " + " | ".join(f"{mask[v].float().mean().item():.1%}" for v in ids.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
