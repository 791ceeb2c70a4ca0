"""Command-line options declared once, on the settings field they fill.

A service's settings dataclass declares each option on its field (``option(...)``): flag,
type, default, help, and how the parsed value becomes the field's value. The argparse
parser, the environment defaults (``<PREFIX><FLAG IN CAPITALS>``) and the conversion from
parsed options to settings are derived from those declarations, so an option is written
once instead of three times (field, ``add_argument``, constructor).

Environment rules, the same for every option:
- a variable that is set and not empty replaces the option's default; argparse applies
  the option's type to string defaults, so an environment value is checked exactly like
  the same value on the command line (a bad one is a usage error, exit code 2);
- a required option is required only when its variable is not set;
- a switch's variable is yes for 1/true/yes/on (any case), no for any other value;
- a value with choices is checked against them wherever it came from (argparse itself
  checks only values given on the command line).

Why our own table and not pydantic-settings: the command line is pinned (``--help``,
exit code 2 with argparse's messages, ``--x/--no-x`` switches, one ``--no-cache`` that
clears ``use_cache``) and env yes/no words are lenient; reproducing those through
pydantic's CLI source would need as much code as this module, plus pydantic's import time
in every agent process.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

TRUE_WORDS = ("1", "true", "yes", "on")
OPTION_KEY = "shardserve.option"
VARIABLE_KEY = "shardserve.variable"
SettingsT = TypeVar("SettingsT")

# value: ``--x VALUE``; switch: ``--x``/``--no-x``; off_switch: only ``--no-x``, which
# clears the field (``--no-cache`` -> ``use_cache = False``).
OptionKind = Literal["value", "switch", "off_switch"]


@dataclass(frozen=True)
class Option:
    """One command-line option (see the module docstring)."""

    flag: str
    default: Any = None
    parse: Callable[[str], Any] = str  # argparse ``type``
    help: str | None = None
    env: str | None = None  # the variable's name after the prefix; None: from the flag
    choices: tuple[str, ...] | None = None
    kind: OptionKind = "value"
    required: bool = False
    to_field: Callable[[Any], Any] | None = None  # parsed value -> field value

    def env_name(self, prefix: str) -> str:
        name = self.env or self.flag.removeprefix("--").removeprefix("no-")
        return prefix + name.upper().replace("-", "_")

    def field_value(self, parsed: Any) -> Any:
        return parsed if self.to_field is None else self.to_field(parsed)


def option(flag: str, default: Any = None, **declaration: Any) -> Any:
    """A settings field filled by the option ``flag`` (keywords: those of ``Option``). The
    field's own default is the option's default, through ``to_field`` when given."""
    declared = Option(flag, default, **declaration)
    return dataclasses.field(
        default_factory=lambda: declared.field_value(default),
        metadata={OPTION_KEY: declared},
    )


def required(flag: str, **declaration: Any) -> dict[str, Option]:
    """Metadata of a field filled by a required option: ``field(metadata=required(...))``
    (a plain ``field`` call, so type checkers see the field has no default)."""
    return {OPTION_KEY: Option(flag, required=True, **declaration)}


def declared_options(settings_class: type) -> Iterator[tuple[str, Option]]:
    """(field name, option) of every option field, in declaration order."""
    for item in dataclasses.fields(settings_class):
        declared = item.metadata.get(OPTION_KEY)
        if isinstance(declared, Option):
            yield item.name, declared


class OptionParser(argparse.ArgumentParser):
    """argparse, checking the choices of environment defaults too."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.choices is not None and value is not None and value not in action.choices:
                allowed = "|".join(str(choice) for choice in action.choices)
                self.error(f"{action.option_strings[0]} must be {allowed}, not {value!r}")
        return parsed, rest


def build_parser(
    settings_class: type,
    environ: Mapping[str, str],
    *,
    prefix: str,
    prog: str,
    description: str,
) -> argparse.ArgumentParser:
    """The command line of ``settings_class``'s options, defaults from ``environ``."""
    parser = OptionParser(prog=prog, description=description)
    for name, declared in declared_options(settings_class):
        _add(parser, name, declared, environ.get(declared.env_name(prefix)) or None)
    return parser


def _add(
    parser: argparse.ArgumentParser, field_name: str, declared: Option, env_value: str | None
) -> None:
    if declared.kind != "value":
        default = declared.default if env_value is None else _yes(env_value)
        if declared.kind == "switch":
            action: Any = argparse.BooleanOptionalAction
            parser.add_argument(declared.flag, action=action, default=default, help=declared.help)
        else:
            parser.add_argument(
                declared.flag,
                dest=field_name,
                action="store_false",
                default=default,
                help=declared.help,
            )
        return
    parser.add_argument(
        declared.flag,
        type=declared.parse,
        choices=declared.choices,
        default=declared.default if env_value is None else env_value,
        required=declared.required and env_value is None,
        help=declared.help,
    )


def _yes(text: str) -> bool:
    return text.strip().lower() in TRUE_WORDS


def option_values(settings_class: type, args: argparse.Namespace) -> dict[str, Any]:
    """The settings fields that ``args`` (parsed by ``build_parser``) fills, by name."""
    return {
        name: declared.field_value(getattr(args, _dest(name, declared)))
        for name, declared in declared_options(settings_class)
    }


def _dest(field_name: str, declared: Option) -> str:
    if declared.kind == "off_switch":
        return field_name
    return declared.flag.removeprefix("--").replace("-", "_")


# ---------------------------------------------------------------- environment-only settings


@dataclass(frozen=True)
class Variable:
    """A setting read from one environment variable only (no command-line option)."""

    name: str
    parse: Callable[[str], Any]


def variable(name: str, default: Any, *, parse: Callable[[str], Any]) -> Any:
    """A settings field filled from the environment variable ``name`` when it is set and
    not empty (``parse`` turns its text into the value, raising ValueError if it cannot)."""
    return dataclasses.field(default=default, metadata={VARIABLE_KEY: Variable(name, parse)})


def from_environment(settings_class: type[SettingsT], environ: Mapping[str, str]) -> SettingsT:
    """``settings_class`` with its ``variable`` fields read from ``environ``."""
    values = {}
    for item in dataclasses.fields(settings_class):  # type: ignore[arg-type]
        declared = item.metadata.get(VARIABLE_KEY)
        if isinstance(declared, Variable) and environ.get(declared.name):
            values[item.name] = declared.parse(environ[declared.name])
    return settings_class(**values)
