"""argparse value types shared by the sub-commands (each names the bad value), the one
declaration of a flag that several commands take (:class:`Flag`), and ``--config FILE``,
options read from YAML (:func:`config_argv`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any, Callable

import yaml


class Flag:
    """One flag: its long name, any other names (``-tp``, as vLLM's) and
    ``argparse.add_argument``'s keywords."""

    def __init__(self, name: str, *aliases: str, **kwargs):
        self.name, self.aliases, self.kwargs = name, aliases, kwargs

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def add(self, parser: argparse.ArgumentParser, passed: bool = False, **overrides) -> argparse.Action:
        """Add it to ``parser`` (or an argument group); ``passed``: as serve takes a worker
        flag (default None or False, help naming the worker's default). The action it
        returns carries this declaration as ``action.flag``."""
        kwargs = dict(self.kwargs, **overrides)
        if passed:
            if kwargs.get("action") != "store_true":
                kwargs["help"] = (f"{kwargs.get('help', '')}; passed to each worker (default: "
                                  f"{kwargs.get('default')})").lstrip("; ")
                kwargs["default"] = None
            else:
                kwargs["help"] = f"{kwargs.get('help', '')}; passed to each worker".lstrip("; ")
        action = parser.add_argument(self.name, *self.aliases, **kwargs)
        action.flag = self
        return action

    def argv(self, value) -> list[str]:
        """The worker command-line words that give it ``value`` (None: not given)."""
        action = self.kwargs.get("action")
        if value is None or value is False and action == "store_true":
            return []
        if action == "store_true":
            return [self.name]
        if action is argparse.BooleanOptionalAction:
            return [self.name if value else "--no-" + self.name.removeprefix("--")]
        return [self.name, str(value)]


def setting(help: str, **kwargs) -> dict:
    """The ``metadata`` of a config dataclass field that is also a flag (:func:`flags_of`):
    its ``help`` and any other ``argparse.add_argument`` keyword (``type``, ``choices``,
    ``metavar``); the flag's name and default are the field's."""
    return {"flag": dict(help=help, **kwargs)}


def flags_of(config_class) -> tuple[Flag, ...]:
    """The flags a config dataclass declares (:func:`setting` fields, in field order):
    ``--field-name`` with the field's default; a ``bool`` field is ``--x`` / ``--no-x``."""
    out = []
    for f in dataclasses.fields(config_class):
        if "flag" not in f.metadata:
            continue
        kwargs = dict(f.metadata["flag"], default=f.default)
        if f.type in (bool, "bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        out.append(Flag("--" + f.name.replace("_", "-"), **kwargs))
    return tuple(out)


def config_from(config_class, args: Any):
    """A config dataclass of the flags it declares (:func:`flags_of`), read from parsed
    ``args`` by their dests; the other fields keep their defaults."""
    return config_class(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)
                           if "flag" in f.metadata})


def from_check(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: the message of the ``ValueError`` it raises is the
    error argparse prints (exit status 2), naming the value."""
    def checked(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    checked.__qualname__ = f"from_check({getattr(parse, '__qualname__', parse)})"
    return checked


# A command's parsed options: the frozen dataclass frozen_options makes of them (a test may pass
# a plain Namespace). Read by attribute, never assigned.
Options = Any


def frozen_options(command: str, args: argparse.Namespace):
    """``args`` as an instance of a frozen dataclass named after the command
    (``ServeOptions`` for serve), one field per option: what a command parsed cannot be
    changed afterwards (assigning raises ``dataclasses.FrozenInstanceError``); a value it
    resolves goes into a copy (:func:`with_values`)."""
    name = "".join(part.title() for part in command.split("-")) + "Options"
    cls = dataclasses.make_dataclass(name, [(dest, object) for dest in vars(args)], frozen=True)
    return cls(**vars(args))


def with_values(args, **values):
    """A copy of parsed options (:func:`frozen_options`, or a plain ``Namespace``) with
    ``values`` (by dest) set: a command derives the options it resolves (a default that
    depends on others, a generated token) without changing the ones it was given."""
    if dataclasses.is_dataclass(args):
        return dataclasses.replace(args, **values)
    return argparse.Namespace(**{**vars(args), **values})


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting whole numbers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {minimum}")
        return value

    return parse


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def _bounded(ok: Callable[[float], bool], bound: str) -> Callable[[str], float]:
    """An argparse type accepting finite numbers for which ``ok`` holds; ``bound`` says which."""

    def parse(text: str) -> float:
        value = _finite(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {bound}")
        return value

    return parse


def float_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type accepting finite numbers >= ``minimum``."""
    return _bounded(lambda v: v >= minimum, f"a finite number >= {minimum:g}")


def float_above(minimum: float) -> Callable[[str], float]:
    """An argparse type accepting finite numbers > ``minimum``."""
    return _bounded(lambda v: v > minimum, f"a finite number > {minimum:g}")


def zero_or_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type accepting 0 (an "off" switch) or finite numbers >= ``minimum``."""
    return _bounded(lambda v: v == 0 or v >= minimum, f"0 or a finite number >= {minimum:g}")


# vLLM's modalities of --limit-mm-per-prompt; epdserve's models take images only.
MM_MODALITIES = ("image", "video", "audio")


def mm_limit_images(text: str) -> int:
    """An argparse type for vLLM's ``--limit-mm-per-prompt``: a JSON object (``{"image": 4}``)
    or ``image=4,video=0`` (vLLM before 0.9), modality -> most items per prompt. Returns the
    image count (0 when absent); a video or audio count other than 0 is refused, as
    epdserve serves no such model, and so is an unknown modality or a bad count."""
    try:
        items = json.loads(text) if text.lstrip().startswith("{") else {
            k.strip(): v for k, _, v in (part.partition("=") for part in text.split(","))}
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a JSON object, e.g. '{{\"image\": 4}}'") from None
    limits = {}
    for key, value in items.items():
        if key not in MM_MODALITIES:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown modality {key!r} (one of {', '.join(MM_MODALITIES)})")
        try:
            limits[key] = int_at_least(0)(str(value))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r}: {key}'s count {value!r} must be a whole number >= 0") from None
    others = [k for k, n in limits.items() if k != "image" and n > 0]
    if others:
        raise argparse.ArgumentTypeError(f"{text!r}: epdserve serves images only, not {', '.join(others)}")
    return limits.get("image", 0)


def slo_pair(keys: tuple[str, ...], positive: bool = False) -> Callable[[str], tuple[str, float]]:
    """An argparse type for one SLO ``KEY:MS`` as vLLM ``bench serve --goodput`` writes it:
    KEY one of ``keys``, MS a finite number >= 0 (ms), > 0 if ``positive`` (a controller
    cannot steer to a target nothing meets); the error names the text."""

    def parse(text: str) -> tuple[str, float]:
        key, sep, value = text.partition(":")
        if not sep or key not in keys:
            raise argparse.ArgumentTypeError(f"{text!r}: expected KEY:MS with KEY one of {', '.join(keys)}")
        try:
            ms = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of ms") from None
        if not (ms > 0 if positive else ms >= 0) or math.isinf(ms):
            raise argparse.ArgumentTypeError(f"{text!r}: SLO must be a finite number {'>' if positive else '>='} 0 ms")
        return key, ms

    return parse


# vLLM's human-readable integers (``--max-model-len 32k``): lowercase suffixes are
# decimal, uppercase binary.
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def tokens_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting whole numbers >= ``minimum`` written plainly or as vLLM
    writes them: ``32k`` (32,000), ``32K`` (32,768), ``25.6k`` (25,600)."""

    def parse(text: str) -> int:
        number, scale = (text[:-1], _SUFFIXES[text[-1]]) if text[-1:] in _SUFFIXES else (text, 1)
        try:
            value = float(number) * scale if scale > 1 else int(number)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number (e.g. 4096, 4k, 4K)") from None
        if not math.isfinite(value) or value != int(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= {minimum}")
        return int(value)

    return parse


def config_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the options of its ``--config FILE`` (YAML, as ``vllm serve --config``)
    put first, so that options on the command line win. FILE maps option names, the long
    flag without ``--`` and with ``-`` or ``_`` (``max-num-seqs`` or ``max_num_seqs``), to
    values: a scalar, a list (an option taking several values), or a boolean (a switch:
    true gives it, false gives ``--no-NAME`` where it has one, else nothing). The values go
    through the option's own type and choices. Exits through ``parser.error`` (status 2,
    naming the file and the key) on a file that cannot be read, that is not a mapping, or
    that names an unknown option."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if path is None:
        return argv
    try:
        with open(path) as f:
            options = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: cannot read it as YAML: {exc}")
    if not isinstance(options, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    actions = {s: a for a in parser._actions for s in a.option_strings}
    words = []
    for key, value in options.items():
        name = "--" + str(key).replace("_", "-")
        action = actions.get(name)
        if action is None or name in ("--config", "--help"):
            parser.error(f"--config {path}: unknown option {key!r}")
        words += _config_words(parser, path, name, action, value)
    return words + argv


def _config_words(parser: argparse.ArgumentParser, path: str, name: str, action, value) -> list[str]:
    """The command-line words of ``name: value`` from a config file (see :func:`config_argv`)."""
    if isinstance(value, bool):
        if action.nargs == 0:  # a switch
            negative = "--no-" + name[2:]
            return [name] if value else [negative] if negative in action.option_strings else []
        value = str(value).lower()
    if action.nargs == 0:
        parser.error(f"--config {path}: {name[2:]} is a switch: give true or false, not {value!r}")
    if isinstance(value, list):
        if action.nargs not in ("+", "*"):
            parser.error(f"--config {path}: {name[2:]} takes one value, not a list")
        return [name, *map(str, value)]
    if value is None or isinstance(value, dict):
        parser.error(f"--config {path}: {name[2:]}: expected a value, not {value!r}")
    return [name, str(value)]
