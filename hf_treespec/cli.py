"""``hf-treespec`` command line. One subcommand per job (``bench``, ``calibrate``); each registers its own parser and
handler in `COMMANDS`, so adding ``train`` is one more entry."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable, Sequence

#: options the --quick preset fills in when not given: the headline rows only (plain, transformers' assisted peer,
#: tree:salf sized by measured cost), 5 questions x 64 tokens, plus the machine's cost curve; <= 3 min on 2 cores
QUICK_PRESET = {"num_questions": 5, "max_new_tokens": 64, "repeats": 1}
QUICK_METHODS = ("plain", "assisted_lookup", "tree:salf")
QUICK_OVERRIDES = ("tree.tree_budget=auto",)
BENCH_DEFAULTS = {"num_questions": None, "max_new_tokens": 128, "repeats": 1}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from .benchmark.methods import available_methods
    from .benchmark.runner import DATASETS, DTYPE_CHOICES
    from .hardware import AUTO_DTYPE_HELP, DEVICE_HELP

    parser = subparsers.add_parser(
        "bench",
        help="measure tree speculation against plain and assisted generate",
        description=(
            "Runs every method on every question (first turn, chat template), interleaved, and reports tokens/s, "
            "speedup over plain generate measured in the same run, tau (new tokens per target forward), the "
            "draft/verify/other time split and, for greedy decoding, token identity with plain generate."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="target: asset short name, checkpoint folder, .gguf file or hub id")
    parser.add_argument("--drafter", default="default",
                        help="default (the feature drafter shipped for --model: hf_treespec.assets.default_drafter), "
                             "truncated:K (target's first K layers), oracle (the whole target drafting for itself: "
                             "the tau a deterministic tree of that policy and budget can hold with a perfect drafter; sampled trees are "
                             "not bounded by it), lookup:N (prompt-lookup tree "
                             "drafting with n-grams up to N), a checkpoint path / hub id, or 'none'")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help=AUTO_DTYPE_HELP)
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every method")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--questions", default=None, help="an MT-bench / Spec-Bench style question.jsonl")
    source.add_argument("--dataset", default="mtbench", choices=sorted(DATASETS))
    parser.add_argument("--num-questions", type=int, default=None, help="first N questions (default: all)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="skip questions whose chat prompt is longer (then --num-questions counts the ones kept)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (64 with --quick)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples for every method")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None, help="sampling only; default off")
    parser.add_argument("--methods", default=None,
                        help="comma list; plain always runs as the baseline (default: all that can run): "
                             + ", ".join(available_methods())
                             + ". A method may carry its own generate kwargs after '@' (they win over --set) and is "
                             "then a row of its own, named as written: tree:iid@verifier=specinfer@tree_paths=4; "
                             "@drafter=<checkpoint> gives a row its own drafter (tree:salf@drafter=runs/gto)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="METHOD.KEY=VALUE",
                        help="generate kwarg for one method and its @ variants (salf.tree_budget=16), for one variant "
                             "by its full name (tree:iid@tree_paths=4.tree_depth=2), for every tree method whose "
                             "policy takes it (tree.tree_budget=16) or for all (*.KEY=VALUE); repeatable")
    parser.add_argument("--sweep", default=None, metavar="KEY=V1,V2,..",
                        help="re-run the tree methods for each value (e.g. tree_budget=8,16,32,60): cost curve")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per (method, question); median kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out", help="output folder")
    parser.add_argument("--quick", action="store_true",
                        help="<= 3-minute preset: plain, assisted_lookup and tree:salf with tree_budget=auto, "
                             "5 questions, 64 new tokens, 1 repeat, and the cost curve (explicit options win)")
    parser.add_argument("--cost-curve", action="store_true",
                        help="add the target's measured verification cost curve to the report (on with --quick)")
    parser.add_argument("--batch-size", default=None, metavar="B1,B2,..",
                        help="batched generate instead: total tokens/s of plain and tree methods on left-padded "
                             "batches of these sizes (e.g. 1,4,16), with a speedup-vs-batch plot")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(handler=run_bench)


def bench_config(args: argparse.Namespace):
    """Namespace -> BenchmarkConfig, applying the --quick preset below explicit options."""
    from .benchmark.methods import parse_override, parse_sweep
    from .benchmark.runner import BenchmarkConfig

    preset = QUICK_PRESET if args.quick else BENCH_DEFAULTS
    filled = {key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in BENCH_DEFAULTS}
    overrides = [parse_override(text) for text in ((*QUICK_OVERRIDES,) if args.quick else ()) + tuple(args.overrides)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    if methods is None and args.quick:
        methods = list(QUICK_METHODS)
    return BenchmarkConfig(
        model=args.model,
        drafter=None if args.drafter.lower() == "none" else args.drafter,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        questions=args.questions,
        dataset=args.dataset,
        max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        methods=methods,
        overrides=overrides,
        sweep=parse_sweep(args.sweep) if args.sweep else None,
        seed=args.seed,
        progress=not args.no_progress,
        cost_curve=args.cost_curve or args.quick,
        **filled,
    )


def run_bench(args: argparse.Namespace) -> int:
    from .benchmark.report import write_report
    from .benchmark.runner import run_benchmark

    if args.batch_size:
        from .benchmark.batched import run_batched_benchmark, write_batched_report

        sizes = [int(x) for x in args.batch_size.split(",") if x.strip()]
        # the report is rewritten after each batch size: an interrupted run keeps what it measured
        def report(rows, settings, echo=False):
            settings["command"] = args.command_line
            return write_batched_report(rows, settings, args.out, echo=echo)

        rows, settings = run_batched_benchmark(bench_config(args), sizes, on_batch_size=report)
        folder = report(rows, settings, echo=True)
        print(f"wrote {folder}/ (batched.md, batched.json, batched.png)")
        return 0

    result = run_benchmark(bench_config(args))
    result.settings["command"] = args.command_line
    folder = write_report(result, args.out, echo=True)
    print(f"\nwrote {folder}/ (table.md, per_question.jsonl, summary.json, plot.png"
          f"{', sweep.png' if result.sweep else ''})")
    return 0


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    from .benchmark.runner import DTYPE_CHOICES
    from .hardware import DEVICE_HELP

    parser = subparsers.add_parser(
        "calibrate",
        help="measure the target's verification cost curve c(rows, context) on this machine",
        description=(
            "Times one target forward per (new rows, cached context) exactly as a tree verification runs, prints the "
            "curve, writes it as JSON to the latency cache tree_budget='auto' reads and as a PNG plot."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="target: asset short name, checkpoint folder, .gguf file or hub id")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64", help="rows per forward (root included)")
    parser.add_argument("--contexts", default="128,512", help="cached context lengths")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per point (fastest kept)")
    parser.add_argument("--batch-size", default="",
                        help="also time [batch, rows] forwards at these batch sizes (comma-separated) against the "
                             "curve's price for batch x rows rows, the premise a batch's tree sizing rests on")
    parser.add_argument("--out", default="calibrate_out", help="folder for curve.json and curve.png")
    parser.set_defaults(handler=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from .benchmark.runner import BenchmarkConfig, load_model, torch_threads
    from .benchmark.report import cost_curve_lines, plot_cost_curve
    from .hardware import detect
    from .cost_curve import cache_path, calibrate_batches, calibrate_target

    def numbers(text: str, name: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"--{name} takes comma-separated whole numbers, got {text!r}.") from None
        if not values or min(values) < 1:
            raise ValueError(f"--{name} needs numbers >= 1, got {text!r}.")
        return values

    sizes, contexts = numbers(args.sizes, "sizes"), numbers(args.contexts, "contexts")
    batches = numbers(args.batch_size, "batch-size") if args.batch_size else ()
    if args.repeats < 1 or args.threads < 1:
        raise ValueError("--repeats and --threads must be >= 1.")
    config = BenchmarkConfig(dtype=args.dtype, device=args.device)
    config.validate()
    dtype = config.resolved_dtype
    model, _ = load_model(args.model, dtype, config.resolved_device)
    with torch_threads(args.threads), torch.no_grad():
        curve = calibrate_target(model.eval(), sizes=sizes, contexts=contexts, repeats=args.repeats)
        cached = cache_path(curve.key)
        checks = calibrate_batches(model, curve, batches, repeats=args.repeats) if batches else []
    hardware = detect(model.device)
    print(f"{args.model} ({dtype}) on {hardware.describe().rsplit(';', 1)[0]}; {args.threads} threads)\n")
    print("\n".join(cost_curve_lines(curve.to_json())[2:]))
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "curve.json").write_text(json.dumps({**curve.to_json(), "hardware": hardware.as_dict()}, indent=1))
    if checks:
        print(f"\n[batch, rows] forwards at context {checks[0].context} vs the curve's price for batch x rows rows")
        print("| batch | rows per sequence | measured ms | curve(batch x rows) ms | measured / curve |")
        print("|---:|---:|---:|---:|---:|")
        for check in checks:
            print(f"| {check.batch} | {check.rows} | {1000 * check.measured:.1f} | {1000 * check.predicted:.1f} | "
                  f"{check.ratio:.2f} |")
        (folder / "batches.json").write_text(json.dumps([{**vars(c), "ratio": c.ratio} for c in checks], indent=1))
    plot_cost_curve(curve, folder / "curve.png", title=f"{args.model} {dtype}, {hardware.name}, {args.threads} thr")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(curve.to_json(), indent=1))
    print(f"\nwrote {folder}/curve.json, {folder}/curve.png and the latency cache {cached}")
    return 0


#: subcommand -> function adding its parser (which sets ``handler``)
COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "bench": add_bench_parser, "calibrate": add_calibrate_parser,
}


def plugin_commands() -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    """Subcommands other installed packages add through the ``hf_treespec.cli`` entry-point group (``train`` comes
    from ``hf_treespec.trainers`` this way, so inference code never imports the training code)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.load() for ep in entry_points(group="hf_treespec.cli") if ep.name not in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-treespec", description="Tree-based speculative decoding for transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in {**COMMANDS, **plugin_commands()}.values():
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["hf-treespec", *argv])  # recorded in reports: the command that made them
    try:
        return args.handler(args)
    except (ValueError, OSError) as error:  # bad input, missing files / packages: a message, not a traceback
        print(f"hf-treespec {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
