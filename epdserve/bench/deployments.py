"""Deployment files for ``epdserve compare --deployments``: the TOML schema (one ``[[deployment]]``
table each), loading with one-line errors, and ``${VAR}`` expansion; keys and examples in
docs/comparing.md, "Deployment files"."""

from __future__ import annotations

import os
import re
import tomllib
import typing
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr,
                      ValidationError, field_validator, model_validator)

from epdserve.model.loader import ModelInfo, resolve_model
from epdserve.serving.deployment import DeploymentSpec
from epdserve.serving.launch.ray_cluster import CLUSTERS, STRATEGIES, parse_resources
from epdserve.serving.deployment import Mode

KINDS = ("epdserve", "processes", "base_url")  # how a deployment starts: exactly one


class DeploymentFileError(ValueError):
    """One line naming the file (``file:line`` for bad TOML), the entry and the key."""


def _http_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s)://HOST[:PORT] URL")
    return text.rstrip("/")


Url = Annotated[str, AfterValidator(_http_url)]


class _Strict(BaseModel):
    # Unknown keys are errors (a misspelt key must not be ignored); no str -> number coercion.
    model_config = ConfigDict(extra="forbid", strict=True)


class ReadyCheck(_Strict):
    url: Url
    status: int = Field(200, ge=100, le=599)
    timeout_s: float = Field(300.0, gt=0)


class ProcessSpec(_Strict):
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = {}
    cwd: str | None = None
    ready: ReadyCheck | None = None


class Resources(_Strict):
    """One of CPU cores or GPUs, and the price in USD per hour."""

    cpu_cores: int | None = Field(None, gt=0)
    gpus: int | None = Field(None, gt=0)
    price_per_hour: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_device_kind(self) -> Resources:
        if self.cpu_cores is not None and self.gpus is not None:
            raise ValueError("give cpu_cores or gpus, not both")
        return self


RayRole = Literal["worker", "prefill", "decode", "encode"]  # serve's --ROLE-resources / --ROLE-placement


# Up to two '/', each before a digit: epdserve's per-role TP sizes (1p1d-tp2/1).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[0-9][A-Za-z0-9._-]*){0,2}$"


class Deployment(_Strict):
    """One ``[[deployment]]`` entry; raises pydantic.ValidationError on a bad key or value."""

    name: str = Field(pattern=NAME_PATTERN, max_length=64)
    epdserve: str | None = None
    args: list[str] | None = None
    processes: list[ProcessSpec] | None = Field(None, min_length=1)
    base_url: Url | None = None
    ready: ReadyCheck | None = None
    openai_base_url: Url | None = None
    model: str | None = None
    metrics_urls: list[Url] | None = None
    resources: Resources | None = None
    mode: Mode | None = None
    engine: str | None = Field(None, min_length=1, max_length=64)
    cluster: Literal[CLUSTERS] | None = None
    ray_address: str | None = Field(None, min_length=1)
    ray_resources: dict[RayRole, str] | None = None
    ray_placement: dict[RayRole, Literal[STRATEGIES]] | None = None
    setup: str | None = Field(None, min_length=1)
    _source: str = PrivateAttr("--configs")

    @field_validator("epdserve")
    @classmethod
    def _known_epdserve_name(cls, name: str) -> str:
        return DeploymentSpec.parse(name).name  # canonical; ValueError names the forms

    @model_validator(mode="after")
    def _consistent(self) -> Deployment:
        self._cluster_args()
        kinds = [k for k in KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}"
                             + (f" (got {' and '.join(kinds)})" if kinds else ""))
        if self.setup is not None and self.processes is None:
            raise ValueError("setup: only for an entry with processes (what installs them)")
        if self.epdserve is None:
            if self.args is not None:
                raise ValueError("args: only for an epdserve entry (put the flags in "
                                 "processes' command)")
            if self.processes is not None and self.openai_base_url is None:
                raise ValueError("openai_base_url: required with processes (the URL "
                                 "their OpenAI server answers on)")
            return self
        derived = [k for k in ("ready", "openai_base_url", "mode", "engine") if getattr(self, k)]
        if self.resources and (self.resources.cpu_cores or self.resources.gpus):
            derived.append("resources.cpu_cores/gpus")
        if derived:
            raise ValueError(f"{', '.join(derived)}: not for an epdserve entry (compare "
                             f"derives them: /health, its router's URL and cores)")
        return self

    def _cluster_args(self) -> None:
        """Put the cluster keys' serve flags before ``args``; raises ValueError."""
        ray_keys = [k for k in ("ray_address", "ray_resources", "ray_placement") if getattr(self, k) is not None]
        if self.cluster is None and not ray_keys:
            return
        if self.epdserve is None:
            keys = (["cluster"] if self.cluster else []) + ray_keys
            raise ValueError(f"{', '.join(keys)}: only for an epdserve entry")
        if ray_keys and self.cluster != "ray":
            raise ValueError(f"{', '.join(ray_keys)}: only with cluster = \"ray\"")
        flags = ["--cluster", self.cluster or "local"]
        if self.ray_address:
            flags += ["--ray-address", self.ray_address]
        for role, text in (self.ray_resources or {}).items():
            parse_resources(text, f"ray_resources.{role}")
            flags += [f"--{role}-resources", text]
        for role, strategy in (self.ray_placement or {}).items():
            flags += [f"--{role}-placement", strategy]
        if (self.args or [])[:len(flags)] != flags:  # once (a record read back holds them already)
            self.args = [*flags, *(self.args or [])]

    @property
    def source(self) -> str:
        """The file it came from ("--configs" for a ``--configs`` name)."""
        return self._source

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def entry_mode(self) -> str | None:
        """``colocated``, ``pd``, ``epd``, ``elastic`` (roles change), or None if unknown."""
        if not self.epdserve:
            return self.mode
        spec = DeploymentSpec.parse(self.epdserve)
        return "elastic" if spec.elastic else spec.mode

    def where(self) -> str:
        return f'{self._source}: deployment "{self.name}"'

    def record(self) -> dict:
        """JSON-able, variables not expanded (secrets from the environment stay out)."""
        return {**self.model_dump(mode="json", exclude_none=True), "source": self._source}

    def resolved_processes(self, env: typing.Mapping[str, str] | None = None) -> list[ProcessSpec]:
        """``~`` and ``${VAR}`` expanded from ``env`` (default ``os.environ``).

        Raises DeploymentFileError for an unset variable without a default."""
        env = os.environ if env is None else env
        out = []
        for i, p in enumerate(self.processes or []):
            at = f"processes[{i}]"
            out.append(p.model_copy(update={
                "command": [_expand(a, env, self, f"{at}.command[{j}]")
                            for j, a in enumerate(p.command)],
                "cwd": _expand(p.cwd, env, self, f"{at}.cwd") if p.cwd else None,
                "env": {k: _expand(v, env, self, f"{at}.env.{k}") for k, v in p.env.items()}}))
        return out


class ModelVariables(Mapping):
    """The environment plus ``EPDSERVE_MODEL_DIR`` and ``EPDSERVE_GGUF`` of ``model`` unless set,
    resolved on first read (a GGUF takes seconds to convert); raises ModelLoadError."""

    NAMES = ("EPDSERVE_MODEL_DIR", "EPDSERVE_GGUF")

    def __init__(self, model: str | None, environ: Mapping[str, str] = os.environ):
        self.model, self.environ = model, environ

    @cached_property
    def _info(self) -> ModelInfo:
        return resolve_model(self.model)

    def __getitem__(self, key: str) -> str:
        if key in self.environ or key not in self.NAMES:
            return self.environ[key]
        if key == "EPDSERVE_MODEL_DIR":
            return str(self._info.path)
        if not self._info.source.endswith(".gguf"):
            raise KeyError(key)  # a Hugging Face directory has no GGUF
        return self._info.source

    def __iter__(self) -> Iterator[str]:
        return iter(self.environ)

    def __len__(self) -> int:
        return len(self.environ)


class DeploymentsFile(_Strict):
    deployment: list[Deployment] = Field(min_length=1)


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(text: str, env: typing.Mapping[str, str], dep: Deployment, key: str) -> str:
    """``${VAR}`` / ``${VAR:-default}`` (default when unset or empty, as in sh), then ``~``."""
    def value(m: re.Match) -> str:
        found = env.get(m[1])
        if found:
            return found
        if m[2] is not None:
            return m[2]
        if found is None:
            raise DeploymentFileError(f"{dep.where()}: {key}: ${{{m[1]}}} is not set "
                                      f"(export it, or write ${{{m[1]}:-default}})")
        return found
    return os.path.expanduser(_VAR.sub(value, text))


def file_stem(name: str) -> str:
    """``name`` with '/' written ``%2F``: no name has a '%', so two never share files."""
    return name.replace("/", "%2F")


def from_config(name: str) -> Deployment:
    """Raises ValueError for an unknown ``--configs`` name."""
    return Deployment(name=name, epdserve=name)


def load(paths: list[str | Path]) -> list[Deployment]:
    """Raises DeploymentFileError: unreadable, not TOML, off the schema, or a name used twice."""
    found: list[Deployment] = []
    for path in paths:
        for dep in load_file(path):
            twin = next((d for d in found if d.name == dep.name), None)
            if twin:
                raise DeploymentFileError(f"{dep.where()}: name: already used by an entry "
                                          f"of {twin.source}; names must be unique")
            found.append(dep)
    return found


def load_file(path: str | Path) -> list[Deployment]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DeploymentFileError(f"{path}: cannot read it: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column (\d+)\)$", str(exc))
        where, what = (f"{path}:{m[1]}", str(exc)[:m.start()].strip() + f" (column {m[2]})"
                       ) if m else (str(path), str(exc))
        raise DeploymentFileError(f"{where}: not valid TOML: {what}") from None
    try:
        deps = DeploymentsFile.model_validate(data).deployment
    except ValidationError as exc:
        raise DeploymentFileError(_describe(path, data, exc)) from None
    for dep in deps:
        dep._source = str(path)
    return deps


def _describe(path: str | Path, data: dict, exc: ValidationError) -> str:
    errors = exc.errors()
    err, loc = errors[0], errors[0]["loc"]
    who = ""
    if len(loc) >= 2 and loc[0] == "deployment" and isinstance(loc[1], int):
        entry = (data.get("deployment") or [None] * (loc[1] + 1))[loc[1]]
        name = entry.get("name") if isinstance(entry, dict) else None
        who = f'deployment "{name}": ' if isinstance(name, str) else f"deployment #{loc[1] + 1}: "
        loc = loc[2:]
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {who}{key + ': ' if key else ''}{_message(err, errors[0]['loc'])}{more}"


def _message(err: dict, loc: tuple) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if loc == ("deployment",) and kind in ("missing", "list_type"):
        return "expected one or more [[deployment]] tables"
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return f"unknown key (the keys here: {', '.join(_fields_at(loc[:-1]))})"
    if kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound:g} (got {got!r})"
    if kind == "too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return f"{got!r}: letters, digits, '.', '_' and '-' only, and up to two '/', each before a digit (it names files)"
    msg = err["msg"].removeprefix("Value error, ")
    return msg if kind == "value_error" else f"{msg} (got {got!r})"


def _fields_at(loc: tuple) -> list[str]:
    model: type[BaseModel] = DeploymentsFile
    for part in loc:
        if isinstance(part, str) and part in model.model_fields:
            nested = _model_in(model.model_fields[part].annotation)
            if nested is None:
                break
            model = nested
    return list(model.model_fields)


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := _model_in(a))), None)
