"""Every command's options are generated from its config dataclasses: one default per setting, in the dataclass."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hf_treespec.cli import build_parser
from hf_treespec.cli_options import (
    OptionsParser, add_options, build_config, cli_fields, comma_list, field_default, none_or, option,
)

#: TrainingArguments fields: transformers' HfArgumentParser maps them (e.g. ``debug``); ours are checked
TRAINING_ARGUMENTS_FIELDS = {f.name for f in dataclasses.fields(__import__("transformers").TrainingArguments)}
#: options a command adds by hand on purpose: short spellings of TrainingArguments options (same dest, no default)
HAND_MADE = {"help", "config"}


def leaf_parsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """``{"bench": parser, "train prepare": parser, ...}``: every command that runs."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(leaf_parsers(sub, f"{prefix}{name} "))
    return found or {prefix.strip(): parser}


COMMANDS = leaf_parsers(build_parser())


def test_every_command_is_found():
    assert {"bench", "calibrate", "train prepare", "train regenerate", "train evaluate", "train export-eagle3",
            "train talf", "train gto", "train nde", "train c2t"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_options_come_from_dataclasses_with_their_defaults(name):
    parser = COMMANDS[name]
    classes = getattr(parser, "config_classes", ())
    assert classes, f"{name}: options not generated from config dataclasses"
    fields = {}
    for cls in classes:
        for f in cli_fields(cls):
            fields.setdefault(f.name, f)
    ours = {f.name for cls in classes for f in dataclasses.fields(cls) if f.name not in TRAINING_ARGUMENTS_FIELDS}
    deliberate = parser.deliberate_defaults
    seen = set()
    for action in parser._actions:
        if action.dest in HAND_MADE or action.default is argparse.SUPPRESS or action.dest in seen:
            continue  # a second spelling of a dest (--no_x) does not set its default: the first one does
        seen.add(action.dest)
        assert action.dest in fields, f"{name}: option {action.option_strings} is not a dataclass field"
        if action.dest not in ours:
            continue
        expected = deliberate.get(action.dest, field_default(fields[action.dest]))
        if expected is dataclasses.MISSING:
            assert action.required, f"{name}: {action.dest} has no default and must be required"
            continue
        default = action.default
        if isinstance(default, str) and action.type is not None and not isinstance(expected, str):
            default = action.type(default)  # argparse converts string defaults through the option's type
        assert default == expected, f"{name}: --{action.dest} defaults to {default!r}, its dataclass to {expected!r}"


@dataclasses.dataclass
class Toy:
    name: str = dataclasses.field(default="a", metadata=option("a name"))
    sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2], metadata=option("sizes",
                                                                                         parse=comma_list(int)))
    extra: list[str] = dataclasses.field(default_factory=list, metadata=option("repeatable", repeat=True,
                                                                               flag="--add"))
    drafter: str | None = dataclasses.field(default="d", metadata=option("or none", parse=none_or(str)))
    progress: bool = dataclasses.field(default=True, metadata=option("progress bar"))
    fast: bool = dataclasses.field(default=False, metadata=option("go fast"))
    kept: int = dataclasses.field(default=3, metadata=option("set by code", hidden=True))


def toy_parser() -> OptionsParser:
    parser = OptionsParser(presets={"--fast": {"sizes": [9], "name": "preset"}})
    return add_options(parser, Toy)


def test_generated_options_parse_lists_switches_repeats_and_none():
    args = toy_parser().parse_args(["--sizes", "3,4", "--add", "x", "--add", "y", "--drafter", "None",
                                    "--no-progress"])
    assert build_config(Toy, args) == Toy(sizes=[3, 4], extra=["x", "y"], drafter=None, progress=False)
    assert not hasattr(args, "kept")
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--sizes", "3,x"])


def test_presets_and_config_file_layer_under_the_command_line(tmp_path):
    parser = toy_parser()
    assert build_config(Toy, parser.parse_args(["--fast"])) == Toy(sizes=[9], name="preset", fast=True)
    config = tmp_path / "run.yaml"
    config.write_text("name: from-file\nsizes: [5]\n")
    args = parser.parse_args(["--fast", "--config", str(config), "--sizes", "7"])
    assert (args.name, args.sizes) == ("from-file", [7])  # flag > file > preset > dataclass
    assert parser.parse_args([]).name == "a"  # presets and files change one parse only
    (tmp_path / "bad.yaml").write_text("nmae: x\n")
    with pytest.raises(ValueError, match="unknown options \\['nmae'\\]"):
        parser.parse_args(["--config", str(tmp_path / "bad.yaml")])


def test_a_type_without_parser_is_refused():
    @dataclasses.dataclass
    class Bad:
        pairs: dict[str, int] = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="needs a parse function"):
        add_options(argparse.ArgumentParser(), Bad)


def test_bench_config_file(tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("num_questions: 3\nmethods: plain,tree:salf\noverrides: [salf.tree_budget=8]\n")
    from hf_treespec.cli import bench_config

    cfg = bench_config(build_parser().parse_args(["bench", "--config", str(config), "--max-new-tokens", "9"]))
    assert (cfg.num_questions, cfg.max_new_tokens, cfg.methods) == (3, 9, ["plain", "tree:salf"])
    assert [(o.selector, o.key, o.value) for o in cfg.overrides] == [("salf", "tree_budget", 8)]
