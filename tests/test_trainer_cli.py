"""The trainer CLIs are generated from the config dataclasses: same defaults, ``--config`` YAML, flags win."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hf_treespec.trainers import TRAINERS
from hf_treespec.cli_options import build_config
from hf_treespec.trainers.cli import SUBCOMMANDS, add_parser, subcommand
from hf_treespec.trainers.objectives.c2t import C2TConfig
from hf_treespec.trainers.objectives.gto import GTOConfig
from hf_treespec.trainers.objectives.nde import NDEConfig

CONFIGS = {**{name: cls.config_class for name, cls in TRAINERS.items()}, "nde": NDEConfig, "gto": GTOConfig,
           "c2t": C2TConfig}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-treespec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train", *argv])


def comparable(config) -> dict:
    skip = {"output_dir", "logging_dir"}  # the CLI picks runs/<name>; logging_dir derives from it
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and f.name not in skip}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cli_defaults_are_the_dataclass_defaults(name, tmp_path):
    config_class = CONFIGS[name]
    args = parse(name, "--data", "somewhere")
    assert args.output_dir == f"runs/{name}"
    assert comparable(build_config(config_class, args)) == comparable(config_class(output_dir="x"))


def test_paper_defaults_live_in_the_dataclasses():
    for name in ("eagle", "hass", "talf"):
        config = CONFIGS[name](output_dir="x")
        assert (config.learning_rate, config.lr_scheduler_type, config.warmup_steps) == (3e-4, "cosine", 0.05), name
        assert (config.adam_beta1, config.adam_beta2, config.max_grad_norm) == (0.9, 0.95, 0.5), name


def test_yaml_config_round_trip_and_flags_override_it(tmp_path):
    import yaml

    values = {"learning_rate": 1e-4, "unroll_steps": 2, "per_device_train_batch_size": 3, "data": "d",
              "draft_vocab_size": 512, "lr_scheduler_type": "linear"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(values))
    args = parse("hass", "--config", str(tmp_path / "run.yaml"), "--unroll-steps", "4", "--lr", "2e-4")
    config = build_config(CONFIGS["hass"], args)
    assert (config.learning_rate, config.unroll_steps, config.per_device_train_batch_size) == (2e-4, 4, 3)
    assert config.lr_scheduler_type == "linear" and (args.data, args.draft_vocab_size) == ("d", 512)
    # what the YAML held comes back out of a config dumped the same way
    dumped = {k: v for k, v in config.to_dict().items() if k in values}
    parsed_again = build_config(CONFIGS["hass"], parse("hass", "--data", "d", *sum(
        ([f"--{k}", str(v)] for k, v in dumped.items()), [])))
    assert comparable(parsed_again) == comparable(config)


def test_yaml_config_with_unknown_option_is_refused(tmp_path):
    (tmp_path / "bad.yaml").write_text("learnig_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown options \['learnig_rate'\]"):
        parse("eagle", "--config", str(tmp_path / "bad.yaml"), "--data", "d")


def test_subcommand_registration_is_one_decorator():
    assert list(SUBCOMMANDS)[:1] == ["prepare"] and {"eagle", "hass", "talf", "nde", "nde-data"} <= set(SUBCOMMANDS)

    @subcommand("demo-step")
    def _add(commands):
        commands.add_parser("demo-step").set_defaults(handler=lambda args: 0)

    try:
        assert parse("demo-step").handler(None) == 0
        with pytest.raises(ValueError, match="registered twice"):
            subcommand("demo-step")(_add)
    finally:
        SUBCOMMANDS.pop("demo-step")


def test_export_eagle3_command_writes_what_from_eagle_reads_back(target, tmp_path, capsys):
    import json

    import torch

    from hf_treespec.drafters.eagle_io import from_eagle
    from test_eagle_io import eagle3_drafter

    drafter = eagle3_drafter(target).tie_to_target(target, embeddings=True, lm_head=True)
    drafter.save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    args = parse("export-eagle3", "--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target"),
                 "--output", str(tmp_path / "eagle3"))
    assert args.handler(args) == 0
    assert json.loads(capsys.readouterr().out)["files"] == ["config.json", "model.safetensors"]
    back = from_eagle(tmp_path / "eagle3", target_model=target).eval()
    ids, states = torch.randint(0, 64, (1, 6)), torch.randn(1, 6, 3 * 32)
    with torch.no_grad():
        assert torch.allclose(back(ids, states).logits, drafter(ids, states).logits, atol=1e-5)


def _train_subparsers() -> dict[str, argparse.ArgumentParser]:
    train = add_parser(argparse.ArgumentParser(prog="hf-treespec").add_subparsers())
    return next(a for a in train._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_dtype_option_accepts_auto():
    """``--dtype auto`` (the machine's fast dtype) works wherever a train command takes a dtype."""
    with_dtype = {name: action for name, sub in _train_subparsers().items() for action in sub._actions
                  if "--dtype" in action.option_strings}
    assert {"prepare", "regenerate", "c2t-data", "gto"} <= set(with_dtype)
    for name, action in with_dtype.items():
        assert "auto" in action.choices, f"train {name} --dtype does not accept auto: {action.choices}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batches_are_pinned_only_for_a_gpu(name):
    """Pinned memory only serves a copy to a GPU; on a CPU it would just make torch warn every epoch."""
    import torch

    assert CONFIGS[name](output_dir="x").dataloader_pin_memory == torch.cuda.is_available()


def _parser_defaults(command: str) -> dict:
    parser = argparse.ArgumentParser(prog="hf-treespec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    train = next(a for a in parser._subparsers._group_actions[0].choices["train"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.default for a in train.choices[command]._actions if a.dest != "help"}


@pytest.mark.parametrize("command, config_path", [
    ("prepare", "hf_treespec.trainers.data.prepared:PrepareConfig"),
    ("c2t-data", "hf_treespec.trainers.objectives.c2t:C2TDataConfig"),
    ("nde-data", "hf_treespec.trainers.data.nde_data:NDEDataConfig"),
])
def test_data_command_defaults_equal_their_config_defaults(command, config_path):
    """An option that restates a data config's field must not drift from it (prepare's --chunk-size once said 32
    against PrepareConfig's 64)."""
    import importlib

    module, _, name = config_path.partition(":")
    config_class = getattr(importlib.import_module(module), name)
    defaults = {f.name: f.default for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING}
    options = _parser_defaults(command)
    # deliberate differences, each for a reason: the command makes TALF data by default (the library config, none);
    # nde-data's verifier follows --temperature (greedy at 0, else the config's specinfer)
    deliberate = {("prepare", "tree_policy"), ("nde-data", "verifier")}
    shared = sorted(set(options) & set(defaults) - {"target", "drafter", "seed"})
    assert len(shared) >= 3, shared
    for key in (k for k in shared if (command, k) not in deliberate):
        assert options[key] == defaults[key], (command, key, options[key], defaults[key])
