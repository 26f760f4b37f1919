"""Command-line options generated from config dataclasses, so a default lives in one place: the dataclass.

A field becomes ``--field-name`` with the field's default, its annotation as the type and ``metadata`` for the rest
(:func:`option` builds it): help, choices, a parser for values that are not plain ``int`` / ``float`` / ``str``
(comma lists, ``none``), extra spellings, repeatable flags, mutually exclusive groups, fields the command line does
not set. Booleans become switches (``--name`` for a default of False, ``--no-name`` for True). The same parsers read a
``--config file.yaml`` of option names to values; flags given on the command line win over the file, which wins over
presets (``--quick``) and the dataclass defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

#: the metadata key under which :func:`option` stores what the command line needs
CLI_KEY = "cli"


@dataclasses.dataclass(frozen=True)
class CLIOption:
    """How one dataclass field appears on the command line."""

    flag: str | None = None  # the option's name when not ``--field-name`` (``--set`` for ``overrides``)
    flags: tuple[str, ...] = ()  # extra spellings (``--lr``)
    parse: Callable[[str], Any] | None = None  # string -> value for types argparse cannot call directly
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    repeat: bool = False  # the flag may be given several times; the values collect in a list
    group: str | None = None  # fields sharing a group name are mutually exclusive
    hidden: bool = False  # not a command-line option (set by code, or by an option of another name)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where it says nothing: a switch (``--no-progress``: the default is not
    giving it) or a help text that already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ExamplesHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """:class:`HelpFormatter` that prints the description as written (a list of example command lines)."""


def option(help: str, **cli: Any) -> dict[str, Any]:
    """``metadata=`` for a dataclass field: its help text and :class:`CLIOption` settings."""
    return {"help": help, CLI_KEY: CLIOption(**cli)}


def cli_settings(field: dataclasses.Field) -> CLIOption:
    return field.metadata.get(CLI_KEY, CLIOption())


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def cli_fields(config_class: type) -> list[dataclasses.Field]:
    """The fields of ``config_class`` that are command-line options."""
    return [f for f in dataclasses.fields(config_class) if f.init and not cli_settings(f).hidden]


def add_options(parser: argparse.ArgumentParser, *config_classes: type, defaults: dict[str, Any] | None = None,
                skip: Iterable[str] = ()) -> argparse.ArgumentParser:
    """Adds one option per field of ``config_classes`` to ``parser`` (and ``--config`` if it has none).

    ``defaults`` replaces a dataclass default for this command only (a deliberate difference, named where the
    command is built); ``skip`` leaves fields out (the command fills them itself)."""
    defaults, skip = dict(defaults or {}), set(skip)
    # recorded on the parser, so a test can check every option against its dataclass
    parser.config_classes = (*getattr(parser, "config_classes", ()), *config_classes)
    parser.deliberate_defaults = {**getattr(parser, "deliberate_defaults", {}), **defaults}
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for config_class in config_classes:
        hints = typing.get_type_hints(config_class)
        for field in cli_fields(config_class):
            if field.name in skip:
                continue
            settings = cli_settings(field)
            default = defaults.pop(field.name, field_default(field))
            kwargs: dict[str, Any] = {"dest": field.name, "help": field.metadata.get("help")}
            kwargs.update(_value_kwargs(field, hints[field.name], settings, default))
            target = parser
            if settings.group:
                if settings.group not in groups:
                    groups[settings.group] = parser.add_mutually_exclusive_group()
                target = groups[settings.group]
            target.add_argument(*_flags(field, hints[field.name], settings, default), *settings.flags, **kwargs)
    if defaults:
        raise ValueError(f"defaults for options that do not exist: {sorted(defaults)}")
    add_config_option(parser)
    return parser


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """``--config FILE.yaml`` on ``parser`` (once): :func:`apply_config_file` reads it before the flags are parsed."""
    if not any(action.dest == "config" for action in parser._actions):
        parser.add_argument("--config", default=None, metavar="FILE.yaml",
                            help="YAML mapping of option names (as in the dataclasses) to values; flags override it")


def _flags(field: dataclasses.Field, annotation: Any, settings: CLIOption, default: Any) -> list[str]:
    if settings.flag:
        return [settings.flag]
    name = field.name.replace("_", "-")
    switch_off = _strip_optional(annotation) is bool and default is True and not settings.parse
    return [f"--no-{name}" if switch_off else f"--{name}"]


def _value_kwargs(field: dataclasses.Field, annotation: Any, settings: CLIOption, default: Any) -> dict[str, Any]:
    if default is dataclasses.MISSING:
        kwargs: dict[str, Any] = {"required": True}
    else:
        kwargs = {"default": list(default) if settings.repeat else default}
    kind = _strip_optional(annotation)
    if kind is bool and not settings.parse:
        return {**kwargs, "action": "store_false" if default is True else "store_true"}
    if settings.repeat:
        kwargs["action"] = "append"
        if typing.get_origin(kind) is list:  # list[X]: each occurrence of the flag is one X
            kind = typing.get_args(kind)[0]
    if settings.parse is not None:
        kwargs["type"] = _reported(settings.parse)
    elif typing.get_origin(kind) is Literal:
        kwargs["type"] = type(typing.get_args(kind)[0])
        kwargs["choices"] = typing.get_args(kind)
    elif kind in (int, float, str):
        kwargs["type"] = kind
    else:
        raise TypeError(f"option {field.name!r} ({annotation}) needs a parse function in its metadata.")
    if settings.choices is not None:
        kwargs["choices"] = settings.choices
    if settings.metavar is not None:
        kwargs["metavar"] = settings.metavar
    return kwargs


def _reported(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ValueError message reaches the user (argparse would replace it with "invalid value")."""
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, TypeError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def build_config(config_class: type, args: argparse.Namespace, **overrides: Any):
    """``config_class`` from the parsed options that are its fields (hidden ones keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in cli_fields(config_class) if hasattr(args, f.name)}
    return config_class(**{**values, **overrides})


# ------------------------------------------------------------------------------------------------------- values
def comma_list(kind: type) -> Callable[[str], list]:
    """Parser of a comma list (``1,14,26``) of ``kind``."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None
    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def none_or(kind: type, none: str = "none") -> Callable[[str], Any]:
    """Parser that maps the word ``none`` (any case) to None and everything else through ``kind``."""
    def parse(text: str) -> Any:
        return None if str(text).lower() == none else kind(text)
    parse.__name__ = f"{kind.__name__} or {none}"
    return parse


# ------------------------------------------------------------------------------------------------------- parser
def config_file_values(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The YAML mapping in ``path``, checked against ``parser``'s option names."""
    try:
        import yaml
    except ImportError:
        raise ImportError("--config reads YAML: pip install pyyaml (or the bench / train extra: pip install '.[bench]' in the hf-treespec clone).") from None
    if not Path(path).is_file():
        raise FileNotFoundError(f"--config {path} does not exist.")
    values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} must hold a mapping of option names to values.")
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown options {unknown}; see --help for the valid names.")
    return values


def apply_config_file(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """Makes the values of ``--config FILE`` in ``args`` (if any) ``parser``'s defaults."""
    if not any(action.dest == "config" for action in parser._actions):
        return
    path = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"), None)
    path = path or next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if path:
        values = config_file_values(parser, path)
        parser.set_defaults(**values)
        for action in parser._actions:  # a required option the file supplies is no longer missing
            if action.dest in values:
                action.required = False


class OptionsParser(argparse.ArgumentParser):
    """An ``argparse`` parser for options made by :func:`add_options`: ``--config`` and presets replace defaults.

    ``presets`` maps a switch (``--quick``) to the defaults it sets; the config file is applied after them."""

    def __init__(self, *args: Any, presets: dict[str, dict[str, Any]] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.presets = dict(presets or {})

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        saved = [(action, action.default, action.required) for action in self._actions]
        saved_defaults = dict(self._defaults)
        try:  # presets and the file change this parse only: the parser can parse again
            for flag, values in self.presets.items():
                if flag in args:
                    self.set_defaults(**values)
            apply_config_file(self, args)
            return super().parse_known_args(args, namespace)
        finally:
            for action, default, required in saved:
                action.default, action.required = default, required
            self._defaults = saved_defaults
