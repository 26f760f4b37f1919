"""``hf-treespec train calibration``: a drafter's rank-conditioned accuracy and calibration on held-out ShareGPT
conversations (the SALF & TALF paper's Figure 2; the measurement is `rank_calibration`), as JSON and a PNG.

    hf-treespec train calibration --num-conversations 20 --roots-per-conversation 16 --output runs/calibration
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_treespec.api import HelpFormatter, add_options, none_or, option

from .common import TargetArguments, set_threads


@dataclass
class CalibrationArguments:
    """``hf-treespec train calibration``: which drafter, on which held-out roots, binned how."""

    output: str = field(metadata=option("folder for calibration.json and calibration.png"))
    drafter: str = field(default="default", metadata=option(
        "'default' (the drafter shipped for --target) or a TreeSpecDrafterModel folder"))
    split: str = field(default="dev", metadata=option("ShareGPT split of the held-out conversations",
                                                      choices=("train", "dev")))
    num_conversations: int = field(default=20, metadata=option("conversations to use"))
    roots_per_conversation: int = field(default=16, metadata=option(
        "root positions drawn (seeded) among each conversation's assistant tokens"))
    max_length: int = field(default=512, metadata=option("tokens kept per conversation"))
    ranks: int = field(default=5, metadata=option("candidate ranks n = 1..RANKS to condition on"))
    bins: int = field(default=10, metadata=option("equal-width confidence bins of the ECE"))
    tree_policy: str | None = field(default="salf", metadata=option(
        "policy whose trees give the rank mix ('none': skip)", parse=none_or(str)))
    tree_budget: int = field(default=60, metadata=option("its tree_budget (the paper's N=60)"))
    seed: int = field(default=0, metadata=option("draws of the roots"))


def add_calibration_parser(commands) -> None:
    p = commands.add_parser("calibration", help="rank-conditioned top-1 accuracy, ECE and reliability of a drafter, "
                                                "and the rank mix of its trees (SALF & TALF paper, Figure 2)",
                            formatter_class=HelpFormatter)
    add_options(p, TargetArguments, CalibrationArguments)
    p.set_defaults(handler=run_calibration)


def run_calibration(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from hf_treespec.api import default_drafter, iter_sharegpt, load_target, TreeSpecDrafterModel, POLICIES

    from ..data.chat import to_messages, tokenize_conversation
    from ..evaluation.rank_calibration import RootRecords, measure_sequence, summarize

    set_threads(args)
    if args.num_conversations < 1 or args.roots_per_conversation < 1 or args.ranks < 1:
        raise ValueError("--num-conversations, --roots-per-conversation and --ranks must be >= 1.")
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    if args.drafter == "default":
        drafter = default_drafter(target, dtype=torch.float32)
    else:
        drafter = TreeSpecDrafterModel.from_pretrained(args.drafter, dtype=torch.float32).tie_to_target(target).eval()
    policy = None if args.tree_policy is None else POLICIES.get(args.tree_policy)(tree_budget=args.tree_budget)
    generator = torch.Generator().manual_seed(args.seed)
    parts, used = [], 0
    start = time.perf_counter()
    bar = tqdm(total=args.num_conversations, desc="calibration", disable=args.no_progress)
    for record in iter_sharegpt(args.split):
        messages = to_messages(record)
        if not messages:
            continue
        ids, mask = tokenize_conversation(tokenizer, messages, max_length=args.max_length)
        # roots whose next token is an assistant token: the target is answering there
        candidates = [r for r in range(1, len(ids) - 1) if mask[r + 1]]
        if len(candidates) < args.roots_per_conversation:
            continue
        pick = torch.randperm(len(candidates), generator=generator)[: args.roots_per_conversation]
        roots = sorted(candidates[i] for i in pick.tolist())
        parts.append(measure_sequence(target, drafter, torch.tensor(ids), roots, ranks=args.ranks, policy=policy))
        used += 1
        bar.update(1)
        if used >= args.num_conversations:
            break
    bar.close()
    records = RootRecords.concat(parts)
    summary = summarize(records, bins=args.bins)
    summary["settings"] = {key: value for key, value in vars(args).items() if key != "handler"}
    summary["settings"].update(conversations=used, roots=int(records.q1.shape[0]), dtype="fp32",
                               seconds=round(time.perf_counter() - start, 1))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_calibration(summary, out / "calibration.png")
    print(json.dumps({r["rank"]: {k: r[k] for k in ("depth1_target_greedy_rate", "depth2_top1_accuracy",
                                                     "depth2_ece_paper")} for r in summary["ranks"]}))
    return 0


def plot_calibration(summary: dict[str, Any], path: Path) -> None:
    """Three panels: the tree's rank mix (Figure 2(a)), depth-2 accuracy / ECE by conditioning rank (Figure 2(b)),
    and the depth-1 reliability diagram per rank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ranks = summary["ranks"]
    shares = summary.get("tree_rank_share")
    figure = Figure(figsize=(15.0, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    mix_ax, acc_ax, rel_ax = figure.subplots(1, 3)
    if shares:
        mix_ax.bar(list(shares), list(shares.values()), color="tab:gray")
        mix_ax.set_title(f"(a) tree nodes by rank ({summary['tree_nodes']} nodes)")
        mix_ax.set_xlabel("rank among siblings")
        mix_ax.set_ylabel("share of tree nodes")
    else:
        mix_ax.set_axis_off()
    xs = [r["rank"] for r in ranks]
    acc_ax.plot(xs, [r["depth2_top1_accuracy"] for r in ranks], marker="o", label="top-1 accuracy")
    acc_ax.plot(xs, [r["depth2_ece_paper"] for r in ranks], marker="s", label="ECE (paper: conf = p(target token))")
    acc_ax.plot(xs, [r["depth2_ece_top1"] for r in ranks], marker="^", label="ECE (conf = max p)")
    acc_ax.set_xticks(xs)
    acc_ax.set_xlabel("rank n of the token fed back at depth 1")
    acc_ax.set_title("(b) next draft, self-conditioned on the rank-n token")
    acc_ax.legend(fontsize=8)
    rel_ax.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle="--")
    for r in ranks:
        rows = r["depth1_reliability"]
        rel_ax.plot([b["confidence"] for b in rows], [b["accuracy"] for b in rows], marker="o",
                    label=f"rank {r['rank']} (ECE {r['depth1_ece']:.3f})")
    rel_ax.set_xlabel("draft probability of the rank-n candidate (bin mean)")
    rel_ax.set_ylabel("rate it is the target's greedy token")
    rel_ax.set_title("(c) depth-1 reliability by rank")
    rel_ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)
