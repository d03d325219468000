"""A settings engine: each field declared once on a dataclass, read from three sources in one order.

    command line  >  environment (MESHNET_*)  >  TOML file  >  defaults

A dataclass declares its fields with :func:`setting` (default, flag, help, check); :func:`settings_of`
turns them into :class:`Setting` objects, from which everything else follows: the argparse options,
the ``MESHNET_<FIELD>`` variables, the TOML keys (the field names) with their types, and the checks.
:func:`read_sources` reads each source into ``{field: (value, where it came from)}`` and
:func:`merged` applies the precedence order and checks every value given, whatever its source.

Every error is a one-line :class:`ConfigError` that names its source: the file and key, the
variable, or the flag. This module knows nothing of meshd's own fields (``daemon.config``).
"""

from __future__ import annotations

import math
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

ENV_PREFIX = "MESHNET_"

# What is wrong with a value, as the end of a sentence ("must be at least 1"), or None when it is fine.
Check = Callable[[typing.Any], str | None]

# field name -> (value, where it came from: "--port", "MESHNET_PORT" or "/path/meshd.toml: port")
Given = dict[str, tuple[object, str]]


def between(low: float, high: float) -> Check:
    """A check that a number lies in ``[low, high]``."""
    return lambda value: None if low <= value <= high else f"must be between {low:g} and {high:g}"


def at_least(low: float) -> Check:
    """A check that a number is ``low`` or more."""
    return lambda value: None if value >= low else f"must be at least {low:g}"


def above(low: float) -> Check:
    """A check that a number is more than ``low``."""
    return lambda value: None if value > low else f"must be greater than {low:g}"


def setting(default, *, flag: str | None, help: str, metavar: str | None = None, choices: tuple[str, ...] = (),
            check: Check | None = None, secret: bool = False):
    """Declare a dataclass field with how the command line, environment and TOML file set it.

    ``flag`` is the command-line option (None: none; the variable and the file still set the field);
    ``choices`` are matched in any case; ``secret`` values are never echoed in an error.
    """
    metadata = {"setting": {"flag": flag, "help": help, "metavar": metavar, "choices": choices, "check": check,
                            "secret": secret}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list of strings"}
_TRUE_WORDS, _FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names where it came from."""


@dataclass(frozen=True)
class Setting:
    """One configuration field as every source sees it: flag, environment variable, TOML type and check."""

    name: str
    kind: type  # str, int, float, bool, or list (of str)
    default: object
    flag: str | None
    help: str
    metavar: str | None
    choices: tuple[str, ...]
    check: Check | None
    secret: bool

    @property
    def env_var(self) -> str:
        """The environment variable that sets this field: ``MESHNET_`` and the field name in capitals."""
        return f"{ENV_PREFIX}{self.name.upper()}"

    @property
    def kind_name(self) -> str:
        """The field's type in words, for error messages."""
        return _KIND_NAMES[self.kind]

    def argparse_options(self) -> dict:
        """Keyword arguments of ``add_argument(self.flag, ...)``.

        The default stays None, so only options the user gave reach the merge. A bool flag sets the
        opposite of the default (``--no-kv-cache``), a list flag repeats (``--peer``).
        """
        options: dict = {"dest": self.name, "default": None, "help": self.help}
        if self.kind is bool:
            return options | {"action": "store_const", "const": not self.default}
        if self.kind is list:
            options["action"] = "append"
        elif self.kind in (int, float):
            options["type"] = self.kind
        if self.choices:
            options |= {"choices": self.choices, "type": str.lower}
        if self.metavar:
            options["metavar"] = self.metavar
        return options

    def parse_text(self, text: str):
        """The value of an environment variable's text; ValueError when it is not of the field's type."""
        text = text.strip()
        if self.kind is list:  # space and/or comma separated
            return [part for part in text.replace(",", " ").split() if part]
        if self.kind is bool:
            if text.lower() not in _TRUE_WORDS + _FALSE_WORDS:
                raise ValueError(text)
            return text.lower() in _TRUE_WORDS
        return self.kind(text)

    def has_type(self, value) -> bool:
        """Whether ``value`` (from the TOML file or a caller) is of this field's type; ints count as floats."""
        if isinstance(value, bool):  # a bool is an int to Python, never to a config file
            return self.kind is bool
        if self.kind is float:
            return isinstance(value, int | float)
        if self.kind is list:
            return isinstance(value, list) and all(isinstance(item, str) for item in value)
        return isinstance(value, self.kind)

    def problem(self, value) -> str | None:
        """What is wrong with a typed value for this field ("must be ..."), or None when it can be used."""
        if self.kind is float and not math.isfinite(value):
            return "must be a finite number"
        if self.kind is str and not value.strip():
            return "must not be empty"
        if self.choices and value.lower() not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return self.check(value) if self.check else None

    def normalized(self, value):
        """The value as the dataclass holds it: floats as float, choices in lower case."""
        if self.kind is float:
            return float(value)
        if self.choices:
            return value.lower()
        return value


def _kind(annotation) -> type:
    """The one type a field holds: int for ``int | None``, list for ``list[str]``."""
    if typing.get_origin(annotation) is list:
        return list
    return next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)


def settings_of(cls: type) -> tuple[Setting, ...]:
    """Every field of the dataclass ``cls``, declared with :func:`setting`, in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Setting(name=f.name, kind=_kind(hints[f.name]),
                default=f.default if f.default is not MISSING else f.default_factory(), **f.metadata["setting"])
        for f in fields(cls)
    )


def read_sources(settings: tuple[Setting, ...], cli: dict, environ: Mapping[str, str],
                 path: Path) -> tuple[Given, Given, Given]:
    """What the command line, the environment and the TOML file at ``path`` give, highest precedence first.

    ``cli`` maps field names to the options the user gave (None: not given). A value of the wrong
    type, or an unknown key or option, is a :class:`ConfigError` naming its source.
    """
    by_name = {s.name: s for s in settings}
    return _from_cli(cli, by_name), _from_environ(environ, settings), _from_toml(path, by_name)


def merged(settings: tuple[Setting, ...], sources: tuple[Given, ...]) -> Given:
    """One value per field given (a higher source replaces a lower one), each checked once.

    ``sources`` is highest precedence first, as :func:`read_sources` returns them.
    """
    by_name = {s.name: s for s in settings}
    given: Given = {}
    for source in reversed(sources):
        given |= source
    for name, (value, where) in given.items():
        problem = by_name[name].problem(value)
        if problem:
            raise ConfigError(f"{where} {problem}" + ("" if by_name[name].secret else f", got {value!r}"))
    return given


def _from_toml(path: Path, by_name: Mapping[str, Setting]) -> Given:
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(data) - set(by_name))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; known keys are {sorted(by_name)}")
    for key, value in data.items():
        if not by_name[key].has_type(value):
            raise ConfigError(f"{path}: {key} must be {by_name[key].kind_name}, got {value!r}")
    return {key: (value, f"{path}: {key}") for key, value in data.items()}


def _from_environ(environ: Mapping[str, str], settings: tuple[Setting, ...]) -> Given:
    given = {}
    for setting in settings:
        text = environ.get(setting.env_var, "")
        if not text.strip():  # a blank variable is an unset one
            continue
        try:
            given[setting.name] = (setting.parse_text(text), setting.env_var)
        except ValueError:
            shown = "" if setting.secret else f"={text!r}"
            expected = "one of " + ", ".join(_TRUE_WORDS + _FALSE_WORDS) if setting.kind is bool else setting.kind_name
            raise ConfigError(f"{setting.env_var}{shown} is not {expected}") from None
    return given


def _from_cli(cli: dict, by_name: Mapping[str, Setting]) -> Given:
    given = {}
    for name, value in cli.items():
        if value is None:  # not given
            continue
        setting = by_name.get(name)
        if setting is None:
            raise ConfigError(f"unknown option {name!r}")
        source = setting.flag or name
        if not setting.has_type(value):
            raise ConfigError(f"{source} must be {setting.kind_name}, got {value!r}")
        if setting.kind is list:  # a repeated option, each maybe a comma-separated list
            value = [part.strip() for item in value for part in item.split(",") if part.strip()]
        given[name] = (value, source)
    return given
