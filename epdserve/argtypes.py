"""argparse value types (errors name the bad value), :class:`Flag` for a flag several commands take, config
dataclasses whose fields are flags (:func:`setting`), and ``--config FILE`` (YAML, as vLLM's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any, Callable

import yaml


class Flag:

    def __init__(self, name: str, *aliases: str, **kwargs):
        self.name, self.aliases, self.kwargs = name, aliases, kwargs

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def add(self, parser: argparse.ArgumentParser, passed: bool = False, **overrides) -> argparse.Action:
        """``passed``: as serve takes a worker flag: default None (the worker keeps its own), help naming the
        worker's default. The action returned carries this declaration as ``action.flag``."""
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
        """Worker command-line words giving ``value``; None: not given."""
        action = self.kwargs.get("action")
        if value is None or value is False and action == "store_true":
            return []
        if action == "store_true":
            return [self.name]
        if action is argparse.BooleanOptionalAction:
            return [self.name if value else "--no-" + self.name.removeprefix("--")]
        return [self.name, str(value)]


def setting(help: str, *names: str, also: tuple[Flag, ...] = (), passed: bool = False, **kwargs) -> dict:
    """``metadata`` of a config dataclass field that is also a flag: ``add_argument``'s keywords. The flag is
    ``--field-name`` unless ``names`` (the first its name); ``also``: other flags that set the field; ``passed``: serve
    passes it to each worker."""
    return {"flag": dict(help=help, **kwargs), "names": names, "also": also, "passed": passed}


def field_of(flag: Flag):
    kwargs = dict(flag.kwargs)
    default = kwargs.pop("default", False if kwargs.get("action") == "store_true" else None)
    return dataclasses.field(default=default, metadata=setting(kwargs.pop("help", ""), flag.name, *flag.aliases,
                                                               **kwargs))


def nested(config_class, title: str | None = None, passed: bool = False):
    """A field holding another config whose flags are its parent's; ``title``: their ``--help`` group."""
    return dataclasses.field(default_factory=config_class,
                             metadata={"nested": config_class, "title": title, "passed": passed})


def passed_to_workers(flags: tuple[Flag, ...]):
    """A config dataclass field holding the values given to ``flags`` by dest (those not
    given are absent): serve takes a worker's flags with default None and passes on those
    given (:meth:`Flag.add`'s ``passed``)."""
    return dataclasses.field(default_factory=dict, metadata={"passed_flags": tuple(flags)})


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def _names(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["names"] or ("--" + f.name.replace("_", "-"),)


def _field_flags(f: dataclasses.Field) -> tuple[Flag, ...]:
    kwargs = dict(f.metadata["flag"], default=_default(f))
    if f.type in (bool, "bool") and "action" not in kwargs:
        kwargs["action"] = argparse.BooleanOptionalAction
    return (Flag(*_names(f), **kwargs), *f.metadata["also"])


def flags_of(config_class, passed: bool = False) -> tuple[Flag, ...]:
    """In field order, nested ones included (``passed``: only those serve passes); a bool is ``--x``/``--no-x``."""
    out: list[Flag] = []
    for f in dataclasses.fields(config_class):
        if "nested" in f.metadata:
            out += flags_of(f.metadata["nested"], passed and not f.metadata["passed"])
        elif "passed_flags" in f.metadata and not passed:
            out += f.metadata["passed_flags"]
        elif "flag" in f.metadata and (f.metadata["passed"] or not passed):
            out += _field_flags(f)
    return tuple(out)


def add_flags(parser, config_class, root=None) -> None:
    """``root``: the parser that holds the groups (argparse does not show a group inside a group)."""
    root = root or parser
    for f in dataclasses.fields(config_class):
        if "nested" in f.metadata:
            title = f.metadata["title"]
            add_flags(root.add_argument_group(title) if title else parser, f.metadata["nested"], root)
        elif "passed_flags" in f.metadata:
            for flag in f.metadata["passed_flags"]:
                flag.add(parser, passed=True)
        elif "flag" in f.metadata:
            for flag in _field_flags(f):
                flag.add(parser)


def given_flags(config) -> list[str]:
    """The flags of ``config``'s own :func:`setting` fields whose value is not None (given), in
    field order; for configs whose None means "not given"."""
    return [_names(f)[0] for f in dataclasses.fields(config)
            if "flag" in f.metadata and getattr(config, f.name) is not None]


def config_from(config_class, args: argparse.Namespace):
    """Fields that are not flags keep their defaults."""
    values = {}
    for f in dataclasses.fields(config_class):
        if "nested" in f.metadata:
            values[f.name] = config_from(f.metadata["nested"], args)
        elif "passed_flags" in f.metadata:
            values[f.name] = {flag.dest: getattr(args, flag.dest) for flag in f.metadata["passed_flags"]
                              if flag.argv(getattr(args, flag.dest))}
        elif "flag" in f.metadata:
            values[f.name] = getattr(args, f.name)
    return config_class(**values)


def from_check(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError's message is the error argparse prints (exit 2)."""
    def checked(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    checked.__qualname__ = f"from_check({getattr(parse, '__qualname__', parse)})"
    return checked


def int_at_least(minimum: int) -> Callable[[str], int]:

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

    def parse(text: str) -> float:
        value = _finite(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {bound}")
        return value

    return parse


def float_at_least(minimum: float) -> Callable[[str], float]:
    return _bounded(lambda v: v >= minimum, f"a finite number >= {minimum:g}")


def float_above(minimum: float) -> Callable[[str], float]:
    return _bounded(lambda v: v > minimum, f"a finite number > {minimum:g}")


def zero_or_at_least(minimum: float) -> Callable[[str], float]:
    return _bounded(lambda v: v == 0 or v >= minimum, f"0 or a finite number >= {minimum:g}")


def parse_range(text: str) -> tuple[int, int]:
    """argparse type: ``MIN:MAX`` or ``N`` tokens, 1 <= MIN <= MAX."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX (integers)") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_rate(text: str) -> float:
    """argparse type: req/s > 0, or ``inf``."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number (use inf for all at once)") from None
    if not (rate > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0 (inf = all at once)")
    return rate


def parse_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in [0, 1], e.g. 0.5")
    return value


def parse_size(text: str) -> tuple[int, int]:
    """argparse type: ``WxH`` pixels, both >= 1."""
    w, sep, h = text.lower().partition("x")
    try:
        size = (int(w), int(h))
    except ValueError:
        size = (0, 0)
    if not sep or min(size) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WxH in pixels, e.g. 448x448")
    return size


# vLLM's modalities of --limit-mm-per-prompt; epdserve's models take images only.
MM_MODALITIES = ("image", "video", "audio")


def mm_limit_images(text: str) -> int:
    """vLLM's ``--limit-mm-per-prompt``: ``{"image": 4}`` or ``image=4,video=0`` (vLLM < 0.9); returns the
    image count. A video or audio count other than 0, an unknown modality or a bad count is refused."""
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
    """One ``KEY:MS`` as vLLM ``bench serve --goodput`` writes it; MS > 0 if ``positive`` (no steering to 0)."""

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


# vLLM's (--max-model-len 32k): lowercase decimal, uppercase binary.
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def tokens_at_least(minimum: int) -> Callable[[str], int]:
    """Plain, or as vLLM writes them: ``32k`` (32,000), ``32K`` (32,768), ``25.6k`` (25,600)."""

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
    """``argv`` with ``--config FILE``'s options first, so that the command line wins. FILE (YAML, as
    ``vllm serve --config``) maps long option names (``-`` or ``_``) to a scalar, a list, or a boolean (true: the
    switch; false: ``--no-NAME`` or nothing). ``parser.error`` (exit 2): unreadable, not a mapping, unknown option."""
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
    if isinstance(value, bool):
        if action.nargs == 0:
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
