"""Tool calling, the request side: OpenAI's ``tools`` / ``tool_choice`` on chat completions, as
vLLM serves them (docs/serving.md, Tool calling); the output's parsers are in ``tool_parsers``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from epdserve.engine.request import MAX_GUIDED_CHARS, GuidedSpec
from epdserve.serving.api.errors import APIError
from epdserve.serving.api.tool_parsers import HermesOutput, NamedOutput, RequiredOutput, ToolOutput

MAX_TOOLS = 128  # OpenAI's limit
MAX_CALLS = 1024  # in one assistant message
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule
PARSERS = ("hermes",)  # vLLM's names
NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDef(BaseModel):
    """A tool's function (OpenAI): ``name`` (``[a-zA-Z0-9_-]{1,64}``), ``description``,
    ``parameters`` (a JSON Schema, checked against the 2020-12 metaschema), ``strict``
    (its calls conform to ``parameters``: see :class:`HermesOutput`). Unknown keys are a
    400: a misspelt ``parameters`` must not make an unconstrained tool."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.fullmatch(v):
            raise ValueError(f"function name {v!r} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict | None) -> dict | None:
        if v is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(v)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
            except RecursionError:
                raise ValueError("not a valid JSON Schema: nested too deeply") from None
        return v

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class ToolDef(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": FunctionDef}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(BaseModel):
    """A call the assistant made earlier: ``arguments`` is OpenAI's JSON text (an object
    is taken too, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")  # SDK message objects carry more, all None

    name: str
    arguments: str | dict[str, Any]

    @field_validator("arguments")
    @classmethod
    def _json(cls, v):
        if isinstance(v, str):
            try:
                json.loads(v)
            except ValueError as exc:
                raise ValueError(f"arguments is not valid JSON: {exc}") from None
        return v


class ToolCallIn(BaseModel):
    """An entry of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def as_template_dict(self) -> dict:
        """``arguments`` parsed, as transformers' templates read it (and vLLM passes it)."""
        args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(args) if isinstance(args, str) else args}}


class ToolRequestFields(BaseModel):
    """A chat request's tool fields (OpenAI's)."""

    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class ToolMessageFields(BaseModel):
    """A chat message's tool fields: an assistant's earlier ``tool_calls``; a ``tool``
    message's ``tool_call_id``, the call it answers (required, as OpenAI requires it)."""

    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_CALLS)
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":  # an empty list, as some clients send, is no call
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {self.role!r}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        return self

    def tool_template_fields(self) -> dict:
        out = {}
        if self.tool_calls:
            out["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class ToolSettings:
    auto: bool = False  # --enable-auto-tool-choice
    parser: str | None = None
    template_tools: bool = False  # the chat template renders ``tools``


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[ToolDef]
    parallel: bool = True  # False: one call at most
    named: str | None = None

    def template_tools(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def guided_spec(self) -> GuidedSpec | None:
        """The JSON Schema forcing "required" or a named function, as vLLM builds it; None otherwise.
        Raises APIError (``tools``): a schema over ``MAX_GUIDED_CHARS``."""
        if self.mode == "named":
            schema = self.function(self.named).schema
        elif self.mode == "required":
            items = {"anyOf": [{"type": "object", "required": ["name", "parameters"], "properties": {
                "name": {"type": "string", "enum": [t.function.name]}, "parameters": t.function.schema}}
                for t in self.tools]}
            schema = {"type": "array", "minItems": 1, "items": items, **({} if self.parallel else {"maxItems": 1})}
        else:
            return None
        try:
            return GuidedSpec(kind="json", value=json.dumps(schema, ensure_ascii=False))
        except ValidationError:
            raise APIError(f"tools: the schema forcing tool_choice {self.mode!r} is over {MAX_GUIDED_CHARS} "
                           "characters; send fewer or smaller tools", param="tools") from None

    def function(self, name: str) -> FunctionDef | None:
        return next((t.function for t in self.tools if t.function.name == name), None)

    def output(self) -> ToolOutput | None:
        """A fresh parser per choice; None: plain text."""
        functions = {t.function.name: t.function for t in self.tools}
        if self.mode == "auto":
            return HermesOutput(functions, self.parallel)
        if self.mode == "required":
            return RequiredOutput(functions)
        return NamedOutput(self.named) if self.mode == "named" else None


def plan_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None, parallel: bool | None,
               settings: ToolSettings) -> ToolPlan | None:
    """None without tools. Raises APIError 400: as docs/serving.md lists (vLLM's rules)."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(f"tools: two functions are named {dup!r}", param="tools")
    if not settings.template_tools:
        raise APIError("tools: the model's chat template has no tool-call format (it ignores `tools`); "
                       "serve it with --chat-template FILE, a template that renders them (e.g. "
                       "examples/templates/hermes_tools.jinja)", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(f"tool_choice: function {choice.function.name!r} is not in tools", param="tool_choice")
        return ToolPlan("named", tools, parallel is not False, choice.function.name)
    if choice == "auto" and not (settings.auto and settings.parser):
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                       'to be set (or pass tool_choice "none", "required" or a function)', param="tool_choice")
    return ToolPlan(choice, tools, parallel is not False)


def tool_chars(body) -> int:
    """A lower bound, as the router's length check needs: names and the shortest JSON of the
    functions' parameters and earlier calls' arguments."""
    def shortest(value) -> int:  # the fewest characters any JSON rendering of value takes
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    tools = sum(len(t.function.name) + shortest(t.function.parameters or {}) for t in body.tools or ())
    calls = (c.as_template_dict()["function"] for m in body.messages for c in m.tool_calls or ())
    return tools + sum(len(f["name"]) + shortest(f["arguments"]) for f in calls)


def tool_settings(auto_tool_choice: bool, parser: str | None, template_tools: bool) -> ToolSettings:
    """Raises ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser`` (vLLM's rule)."""
    if auto_tool_choice and not parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return ToolSettings(auto_tool_choice, parser, template_tools)
