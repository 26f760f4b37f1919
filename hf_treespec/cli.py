"""``hf-treespec`` command line. One subcommand per job (``bench``, ``calibrate``, ``export-openvino``); each registers
its own parser and handler in `COMMANDS`, so adding ``train`` is one more entry."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .cli_options import HelpFormatter, OptionsParser, add_options, build_config, comma_list, option
from .cost.hardware import AUTO_DTYPE, AUTO_DTYPE_HELP, DEVICE_HELP, DTYPE_CHOICES

#: what --quick sets when not given on the command line: the headline rows only (plain generate, plain decoding through
#: the compiled target, transformers' assisted peer, tree:salf sized by measured cost, eager and compiled),
#: 5 questions x 64 tokens, plus the machine's eager and compiled cost curves
QUICK_PRESET = {"num_questions": 5, "max_new_tokens": 64, "repeats": 1, "cost_curve": True,
                "methods": ["plain", "plain@compile=true", "assisted_lookup", "tree:salf", "tree:salf@compile=true"],
                "overrides": ["tree.tree_budget=auto"]}
#: the row --quick adds where the [openvino] extra is installed: OpenVINO GenAI's greedy loop, the CPU engine to beat
QUICK_OPENVINO = "openvino"
#: where the OpenVINO runtime is installed, --quick's compiled rows run through the OpenVINO target step
#: (``compile_config=CompileConfig(backend="openvino")``) instead of inductor's: the faster step on every CPU measured,
#: ready in seconds where inductor compiles for minutes in every process
QUICK_COMPILED_ROWS = {"plain@compile=true": "plain@compile=openvino",
                       "tree:salf@compile=true": "tree:salf@compile=openvino"}


def quick_preset() -> dict:
    """`QUICK_PRESET`, with OpenVINO GenAI's row after the stock peers where the ``[openvino]`` extra is installed
    (without it the row is absent; ``--methods openvino`` then says how to install it), and the compiled rows through
    the OpenVINO target step where the OpenVINO runtime is (`QUICK_COMPILED_ROWS`)."""
    from .benchmark.openvino import openvino_available
    from .compiled.openvino_export import openvino_installed

    preset = {**QUICK_PRESET, "methods": list(QUICK_PRESET["methods"])}
    methods = preset["methods"]
    if openvino_installed():
        methods[:] = [QUICK_COMPILED_ROWS.get(method, method) for method in methods]
    if openvino_available():
        methods.insert(methods.index("assisted_lookup") + 1, QUICK_OPENVINO)
    return preset


@dataclass
class BenchOutput:
    """What ``hf-treespec bench`` does with a :class:`~hf_treespec.benchmark.runner.BenchmarkConfig` besides running it."""

    out: str = field(default="bench_out", metadata=option("output folder"))
    quick: bool = field(default=False, metadata=option(
        "preset: plain generate, plain decoding through the compiled target (plain@compile=true), assisted_lookup, "
        "and tree:salf with tree_budget=auto, eager and compiled (the compiled rows through the OpenVINO target "
        "step, @compile=openvino, where OpenVINO is installed), and OpenVINO GenAI's greedy loop (openvino) where "
        "the [openvino] extra is installed (its first run on a machine exports the target to an OpenVINO IR: about "
        "4 minutes for SmolLM2-135M on 2 cores, most of it making optimum-intel's environment, then ~30 s per "
        "model; cached); 5 questions, 64 new tokens, "
        "1 repeat, and the eager and compiled cost curves (options given win)"))
    batch_size: list[int] | None = field(default=None, metadata=option(
        "batched generate instead: total tokens/s of plain and tree methods on left-padded batches of these sizes "
        "(e.g. 1,4,16), with a speedup-vs-batch plot", parse=comma_list(int), metavar="B1,B2,.."))


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from .benchmark.methods import available_methods
    from .benchmark.runner import BenchmarkConfig

    parser = subparsers.add_parser(
        "bench",
        help="measure tree speculation against plain and assisted generate",
        description=(
            "Runs every method on every question (first turn, chat template), interleaved, and reports tokens/s, "
            "speedup over plain generate measured in the same run, tau (new tokens per target forward), the "
            "draft/verify/other time split and, for greedy decoding, token identity with plain generate."
        ),
        formatter_class=HelpFormatter,
        presets={"--quick": quick_preset()},
    )
    add_options(parser, BenchmarkConfig, BenchOutput)
    methods = next(action for action in parser._actions if action.dest == "methods")
    methods.help += ". Methods here: " + ", ".join(available_methods())
    parser.set_defaults(handler=run_bench)


def bench_config(args: argparse.Namespace):
    """The parsed options as a :class:`~hf_treespec.benchmark.runner.BenchmarkConfig`."""
    from .benchmark.runner import BenchmarkConfig

    return build_config(BenchmarkConfig, args)


def run_bench(args: argparse.Namespace) -> int:
    from .benchmark.report import write_report
    from .benchmark.runner import run_benchmark

    if args.batch_size:
        from .benchmark.batched import run_batched_benchmark, write_batched_report

        sizes = args.batch_size
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


def _positive_ints(text: str) -> list[int]:
    values = comma_list(int)(text)
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated whole numbers >= 1, got {text!r}")
    return values


@dataclass
class CalibrateOptions:
    """``hf-treespec calibrate``: where the target runs and which (rows, context) points of its cost curve to time."""

    model: str = field(default="smollm2-135m-instruct", metadata=option(
        "target: asset short name, checkpoint folder, .gguf file or hub id"))
    dtype: str = field(default=AUTO_DTYPE, metadata=option(AUTO_DTYPE_HELP, choices=DTYPE_CHOICES))
    device: str = field(default="auto", metadata=option(DEVICE_HELP))
    threads: int = field(default=2, metadata=option("torch.set_num_threads"))
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], metadata=option(
        "rows per forward (root included)", parse=_positive_ints, metavar="N1,N2,.."))
    contexts: list[int] = field(default_factory=lambda: [128, 512], metadata=option(
        "cached context lengths", parse=_positive_ints, metavar="C1,C2,.."))
    repeats: int = field(default=3, metadata=option("timed repeats per point (fastest kept)"))
    batch_size: list[int] = field(default_factory=list, metadata=option(
        "also time [batch, rows] forwards at these batch sizes against the curve's price for batch x rows rows, the "
        "premise a batch's tree sizing rests on", parse=_positive_ints, metavar="B1,B2,.."))
    out: str = field(default="calibrate_out", metadata=option("folder for curve.json and curve.png"))
    compile: bool = field(default=False, metadata=option(
        "also measure the curve through the compiled target forward (what generate(compile_config=...) runs; "
        "compiles first, minutes on a small CPU) and plot both"))

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.threads < 1:
            raise ValueError("repeats and threads must be >= 1.")


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the target's verification cost curve c(rows, context) on this machine",
        description=(
            "Times one target forward per (new rows, cached context) exactly as a tree verification runs, prints the "
            "curve, writes it as JSON to the latency cache tree_budget='auto' reads and as a PNG plot."
        ),
        formatter_class=HelpFormatter,
    )
    add_options(parser, CalibrateOptions)
    parser.set_defaults(handler=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from .benchmark.runner import BenchmarkConfig, load_model, torch_threads
    from .benchmark.report import cost_curve_lines, plot_cost_curve
    from .cost.hardware import detect
    from .cost.curve import cache_path, calibrate_batches, calibrate_target

    options = build_config(CalibrateOptions, args)
    sizes, contexts, batches = tuple(options.sizes), tuple(options.contexts), tuple(options.batch_size)
    config = BenchmarkConfig(dtype=options.dtype, device=options.device)
    config.validate()
    dtype = config.resolved_dtype
    model, _ = load_model(options.model, dtype, config.resolved_device)
    with torch_threads(options.threads), torch.no_grad():
        curve = calibrate_target(model.eval(), sizes=sizes, contexts=contexts, repeats=options.repeats)
        cached = cache_path(curve.key)
        checks = calibrate_batches(model, curve, batches, repeats=options.repeats) if batches else []
    compiled_curve = None
    if options.compile:
        from .compiled import CompileSettings, compiled_forward_for

        compiled = compiled_forward_for(model, CompileSettings.recommended(model.device))  # = CompileConfig()
        with torch_threads(options.threads):
            compiled.warm_up()
            if compiled.failure is not None:
                raise ValueError(f"compiling the target's forward failed: {compiled.failure}")
            compiled_curve = calibrate_target(model, sizes=sizes, contexts=contexts, repeats=options.repeats,
                                              compiled=compiled)
    hardware = detect(model.device)
    print(f"{options.model} ({dtype}) on {hardware.describe().rsplit(';', 1)[0]}; {options.threads} threads)\n")
    print("\n".join(cost_curve_lines(curve.to_json())))
    folder = Path(options.out)
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
    title = f"{options.model} {dtype}, {hardware.name}, {options.threads} thr"
    plot_cost_curve(curve, folder / "curve.png", title=title)
    written = [curve]
    if compiled_curve is not None:
        from .benchmark.report import plot_cost_curves

        print("\n" + "\n".join(cost_curve_lines(compiled_curve.to_json(), compiled=True)))
        (folder / "compiled_curve.json").write_text(
            json.dumps({**compiled_curve.to_json(), "hardware": hardware.as_dict()}, indent=1))
        plot_cost_curves({"eager": curve, "compiled": compiled_curve}, folder / "curves.png", title=title)
        written.append(compiled_curve)
    for measured in written:
        cached = cache_path(measured.key)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(measured.to_json(), indent=1))
    extra = ", compiled_curve.json, curves.png" if compiled_curve is not None else ""
    print(f"\nwrote {folder}/curve.json, {folder}/curve.png{extra} and the latency cache")
    return 0


@dataclass
class ExportOpenVINOOptions:
    """``hf-treespec export-openvino``: the target whose OpenVINO IR the bench's ``openvino`` row reads."""

    model: str = field(default="smollm2-135m-instruct", metadata=option(
        "target: asset short name, checkpoint folder, .gguf file or hub id (as --model of bench)"))


def add_export_openvino_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-openvino",
        help="export the target to the OpenVINO IR that bench's openvino row reads (done at first use otherwise)",
        description=(
            "Exports the target's weights with optimum-intel (optimum-cli export openvino --task "
            "text-generation-with-past --weight-format fp32) into the cache, where hf-treespec bench --methods "
            "openvino finds it. optimum-intel runs from an environment of its own, made on first use (python -m venv, pip; "
            "a few minutes, once per machine). Needs the [openvino] extra."
        ),
        formatter_class=HelpFormatter,
    )
    add_options(parser, ExportOpenVINOOptions)
    parser.set_defaults(handler=run_export_openvino)


def run_export_openvino(args: argparse.Namespace) -> int:
    from .benchmark.loading import load_model
    from .benchmark.openvino import ensure_ir, require_genai

    options = build_config(ExportOpenVINOOptions, args)
    require_genai()
    model, _ = load_model(options.model, "fp32")  # the folder it was loaded from is what gets exported
    ir = ensure_ir(model)
    made = f"exported in {ir.export_seconds:.0f} s" if ir.export_seconds is not None else "already cached"
    print(f"{ir.folder} ({made}; {ir.provenance.get('exporter')})")
    return 0


#: subcommand -> function adding its parser (which sets ``handler``)
COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "bench": add_bench_parser, "calibrate": add_calibrate_parser, "export-openvino": add_export_openvino_parser,
}


def plugin_commands() -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    """Subcommands other installed packages add through the ``hf_treespec.cli`` entry-point group (``train`` comes
    from ``hf_treespec.trainers`` this way, so inference code never imports the training code)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.load() for ep in entry_points(group="hf_treespec.cli") if ep.name not in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-treespec", description="Tree-based speculative decoding for transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OptionsParser)
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
    except (ValueError, OSError, ImportError) as error:  # bad input, missing files / packages: a message, not a traceback
        print(f"hf-treespec {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
