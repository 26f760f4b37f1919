"""``hf-treespec train ...``: the ``train`` command group (examples: `TRAIN_DESCRIPTION`).

``hf_treespec`` never imports this package: the ``hf-treespec`` command finds :func:`add_parser` through the
``hf_treespec.cli`` entry-point group.

Every subcommand's options are generated from its config dataclasses, whose defaults are the only ones: the trainers'
(``eagle`` / ``hass`` / ``talf`` / ``ttt`` / ``gto`` / ``nde`` / ``c2t``, every ``TrainingArguments`` field included)
through transformers' ``HfArgumentParser``, the others through ``hf_treespec.cli_options``; every subcommand also takes
``--config run.yaml`` (option names as keys; flags given on the command line win). A new subcommand is one function
decorated with ``@subcommand("name")``; this module keeps only that registry, each command group's parser and
handler live in its own module (``prepare_cli``, ``train_cli``, ``nde_cli``, ``gto_cli``, ``c2t_cli``,
``regenerate``), imported when the ``train`` parser is built.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from hf_treespec.api import ExamplesHelpFormatter, add_options, option

from .commands.common import ConfigParser, set_threads  # noqa: F401  (re-exported)
from .data.regenerate import add_regenerate_parser


#: ``hf-treespec train --help``: what the steps are, in the order a drafter is made
TRAIN_DESCRIPTION = """\
Train drafters for tree-speculative decoding: self-distilled data, EAGLE / HASS / TALF / EAGLE-3 TTT / GTO training,
acceptance per depth, and the NDE delay selector and C2T classifier. Typical steps:

  hf-treespec train regenerate --num-prompts 1000 --temperature 0,0.8 --output runs/regen/train
  hf-treespec train prepare --data-file runs/regen/train --output runs/data/train
  hf-treespec train eagle --data runs/data/train --output-dir runs/eagle
  hf-treespec train talf --data runs/data/train --init runs/eagle --output-dir runs/talf
  hf-treespec train evaluate --data runs/data/dev --drafter runs/talf

Others: prepare --input-mode eagle3 + ttt (EAGLE-3 training-time test), gto (from a trained drafter),
calibration, nde-data + nde (delay selector), c2t-data + c2t (tree classifier), static-shape.
Every step takes --config run.yaml and resumes when rerun with the same --output / --output-dir.
`hf-treespec train STEP --help` lists a step's options.
"""


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
                                   description=TRAIN_DESCRIPTION, formatter_class=ExamplesHelpFormatter)
    commands = parser.add_subparsers(dest="train_command", required=True, metavar="STEP", parser_class=ConfigParser)
    for add in SUBCOMMANDS.values():
        add(commands)
    return parser


@subcommand("prepare")
def _add_prepare(commands) -> None:
    from .commands.prepare import add_prepare_parser

    add_prepare_parser(commands)


def _add_trainer(name: str) -> Callable[[Any], None]:
    def add(commands) -> None:
        from .commands.train import add_trainer_parser

        add_trainer_parser(commands, name)
    return add


for _name in ("eagle", "hass", "talf", "ttt"):
    subcommand(_name)(_add_trainer(_name))


@subcommand("evaluate")
def _add_evaluate(commands) -> None:
    from .commands.train import add_evaluate_parser

    add_evaluate_parser(commands)


@subcommand("calibration")
def _add_calibration(commands) -> None:
    from .commands.calibration import add_calibration_parser

    add_calibration_parser(commands)


@subcommand("nde-data")
def _add_nde_data(commands) -> None:
    from .commands.nde import add_nde_data_parser

    add_nde_data_parser(commands)


@subcommand("nde")
def _add_nde(commands) -> None:
    from .commands.nde import add_nde_parser

    add_nde_parser(commands)


# ------------------------------------------------------------------------------------------------------- export
@dataclass
class ExportArguments:
    """``hf-treespec train export-eagle3``: which drafter, its target, where the EAGLE-3 layout goes."""

    drafter: str = field(metadata=option("TreeSpecDrafterModel folder"))
    output: str = field(metadata=option("folder for config.json + model.safetensors"))
    target: str = field(default="smollm2-135m-instruct", metadata=option(
        "its target (asset short name, checkpoint folder or .gguf): a shared LM head is written out"))


@subcommand("export-eagle3")
def _add_export(commands) -> None:
    p = commands.add_parser("export-eagle3", help="write a TreeSpecDrafterModel (input_mode eagle3) in the EAGLE-3 "
                                                  "layout (a feature norm as norm_before_fc)")
    add_options(p, ExportArguments)
    p.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    import torch

    from transformers import AutoModelForCausalLM

    from hf_treespec.api import TARGETS, load_target, TreeSpecDrafterModel, to_eagle3

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
    from .commands.gto import add_gto_parser  # GTO keeps its parser in its own module

    add_gto_parser(commands)


@subcommand("c2t")
def _add_c2t(commands) -> None:
    from .commands.c2t import add_c2t_commands  # c2t-data, c2t and static-shape

    add_c2t_commands(commands, set_threads)
