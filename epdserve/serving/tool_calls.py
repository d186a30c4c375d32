"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` on chat completions, as vLLM serves them.

The request side: :class:`ToolDef` (a function with a JSON-schema ``parameters``),
``tool_choice`` "none" | "auto" | "required" | :class:`NamedToolChoice`, and the
assistant's earlier :class:`ToolCallIn` in messages. :func:`plan_tools` checks a request
against the server's :class:`ToolSettings` and gives the :class:`ToolPlan` that drives it:

* "none": the tools are rendered into the prompt (vLLM does so too), the output is text;
* "auto" (needs ``--enable-auto-tool-choice --tool-call-parser hermes``, as vLLM): the
  model writes Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, which :class:`HermesOutput` turns into ``tool_calls``;
* "required" and a named function: the output is forced with structured output, on
  vLLM's schemas (:meth:`ToolPlan.guided_schema`): an array of ``{"name", "parameters"}``
  (at least one) or the named function's ``parameters`` object, and becomes ``tool_calls``
  directly (:class:`RequiredOutput`, :class:`NamedOutput`).

Each output class turns a choice's text, piece by piece, into OpenAI chat ``delta`` dicts
(``{"content"}`` or ``{"tool_calls": [{"index", ...}]}``) and a final ``finish_reason``
("tool_calls" when the model chose to call and stopped by itself); a non-streamed
message is those deltas merged (:meth:`ToolOutput.message`), so both always agree.
"""

from __future__ import annotations

import argparse
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import referencing.exceptions
from pydantic import BaseModel, ConfigDict, Field, field_validator

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format's markers
MAX_TOOLS = 128  # OpenAI's limit on tools per request
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
PARSERS = ("hermes",)  # --tool-call-parser values (vLLM's names)
# Parameters of a function that declares none (vLLM uses the same for named tool_choice).
NO_PARAMETERS = {"type": "object", "properties": {}}


# ---------------------------------------------------------------------------- requests

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
        """``parameters``, or an object of no properties when none were given."""
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
        """The call as chat templates read it (transformers' convention, as vLLM passes
        it): ``arguments`` parsed into its JSON value."""
        args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(args) if isinstance(args, str) else args}}


# ------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class ToolSettings:
    """The server's tool options: ``auto`` (``--enable-auto-tool-choice``), ``parser``
    (``--tool-call-parser``), ``template_tools`` (the chat template renders ``tools``)."""

    auto: bool = False
    parser: str | None = None
    template_tools: bool = False


class ToolRequestError(ValueError):
    """A request whose tool fields cannot be served; ``param`` names the field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: ``mode`` "none", "auto", "required" or "named"
    (``named``: the function's name); ``parallel``: False allows one call at most."""

    mode: str
    tools: list[ToolDef]
    parallel: bool = True
    named: str | None = None

    def template_tools(self) -> list[dict]:
        """``tools`` as the chat template gets them (OpenAI's JSON, as transformers and vLLM pass it)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def guided_schema(self) -> str | None:
        """The JSON Schema (its JSON text) that forces the output, as vLLM builds it: for
        "required" an array (1 item at least; at most 1 without parallel calls) of
        ``{"name": <a tool>, "parameters": <its schema>}`` (``anyOf`` over the tools); for a
        named function its parameters object; None otherwise."""
        if self.mode == "named":
            return json.dumps(self.function(self.named).schema)
        if self.mode != "required":
            return None
        items = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                             "parameters": t.function.schema},
                            "required": ["name", "parameters"]} for t in self.tools]}
        schema = {"type": "array", "minItems": 1, "items": items}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def function(self, name: str) -> FunctionDef | None:
        """The tool function called ``name``, None if there is none."""
        return next((t.function for t in self.tools if t.function.name == name), None)

    def output(self) -> ToolOutput | None:
        """A fresh parser of one choice's output; None: the output is plain text."""
        if self.mode == "auto":
            return HermesOutput(self)
        if self.mode == "required":
            return RequiredOutput(self)
        return NamedOutput(self.named) if self.mode == "named" else None


def plan_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None, parallel: bool | None,
               settings: ToolSettings) -> ToolPlan | None:
    """The :class:`ToolPlan` of a request's ``tools``, ``tool_choice`` and
    ``parallel_tool_calls``; None when it has no tools. ``tool_choice`` defaults to "auto"
    with tools (OpenAI); "none" needs no tools (vLLM).

    Raises:
        ToolRequestError: ``tool_choice`` without ``tools``; a named function not among
            them; two tools of one name; ``tools`` with a chat template that has no tool
            format; "auto" without ``--enable-auto-tool-choice`` (vLLM's rule).
    """
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ToolRequestError(f"tools: two functions are named {dup!r}", "tools")
    if not settings.template_tools:
        raise ToolRequestError("tools: the model's chat template has no tool-call format (it ignores `tools`); "
                               "serve it with --chat-template FILE, a template that renders them (e.g. "
                               "examples/templates/hermes_tools.jinja)", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ToolRequestError(f"tool_choice: function {choice.function.name!r} is not in tools", "tool_choice")
        return ToolPlan("named", tools, parallel is not False, choice.function.name)
    if choice == "auto" and not (settings.auto and settings.parser):
        raise ToolRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                               'to be set (or pass tool_choice "none", "required" or a function)', "tool_choice")
    return ToolPlan(choice, tools, parallel is not False)


def tool_chars(body) -> int:
    """Characters a chat request's tools put in its prompt, at the least: each function's
    name and parameters JSON (a tool format renders the signatures), and the earlier
    calls' names and arguments. Counted with the messages' text by the router's length
    check, which must stay a lower bound."""
    def shortest(value) -> int:  # the fewest characters any JSON rendering of value takes
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    tools = sum(len(t.function.name) + shortest(t.function.parameters or {}) for t in body.tools or ())
    calls = (c.as_template_dict()["function"] for m in body.messages for c in m.tool_calls or ())
    return tools + sum(len(f["name"]) + shortest(f["arguments"]) for f in calls)


def add_tool_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags: ``--chat-template``, ``--enable-auto-tool-choice``,
    ``--tool-call-parser``."""
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template (a file, or the template itself) to use instead of the model's; "
                             "one with a tool format (e.g. examples/templates/hermes_tools.jinja) enables `tools`")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                        help="format of the model's tool calls: hermes, <tool_call>{json}</tool_call> blocks")


def tool_settings(args: argparse.Namespace, template_tools: bool) -> ToolSettings:
    """The :class:`ToolSettings` of parsed options.

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser`` (vLLM's rule).
    """
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser, template_tools)


# ----------------------------------------------------------------------------- outputs

def conforms(value, schema: dict) -> bool:
    """Whether ``value`` is valid against ``schema``; False too when the schema cannot be
    applied (a ``$ref`` it cannot resolve: no reference is fetched; too deep a nesting),
    since then it is not known to conform."""
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    except (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError):
        return False


def new_call_id() -> str:
    """A tool call id in OpenAI's form, ``call_`` and 24 characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_deltas(index: int, name: str, arguments: str) -> list[dict]:
    """A whole call as stream deltas: the first names it (id, type, name), the next
    carries the arguments, as OpenAI streams them."""
    head = {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]


class ToolOutput:
    """One choice's output to OpenAI deltas: :meth:`feed` each new piece of text,
    :meth:`finish` once with the engine's finish reason."""

    calls = 0

    def feed(self, text: str) -> list[dict]:
        """Deltas for the new ``text`` (possibly none: text held until it is understood)."""
        raise NotImplementedError

    def flush(self) -> list[dict]:
        """Deltas for what is still held when the output has ended."""
        return []

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """The last deltas and the finish reason: "tool_calls" when a call was made and
        the model stopped by itself (a "length" cut stays "length")."""
        deltas = self.flush()
        return deltas, "tool_calls" if self.calls and reason == "stop" else reason

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """A non-streamed answer: the assistant message (``content`` None when only calls
        were made) and the finish reason, the streamed deltas merged."""
        deltas = self.feed(text)
        more, reason = self.finish(reason)
        content, calls = [], []
        for d in deltas + more:
            content.append(d.get("content", ""))
            for c in d.get("tool_calls", ()):
                if "id" in c:
                    calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
                else:
                    calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        text = "".join(content)
        message = {"role": "assistant", "content": None if calls and not text else text}
        if calls:
            message["tool_calls"] = calls
        return message, reason


@dataclass
class HermesOutput(ToolOutput):
    """Hermes tool calls in free text (``tool_choice`` "auto", vLLM's ``hermes`` parser).

    Text outside ``<tool_call>...</tool_call>`` is content, streamed as it comes, but never
    any part of the markers (a piece that may begin one is held until it is clear);
    whitespace next to a call is dropped. A block is held until it closes (or the output
    ends, as vLLM takes an unclosed last block too) and becomes a call when it is a JSON
    object with a ``name`` among the tools and an object ``arguments`` (for a ``strict``
    tool, arguments valid against its parameters); any other block stays content, markers
    and all, as vLLM leaves what it cannot parse. With ``parallel_tool_calls`` false, calls
    after the first are dropped.
    """

    plan: ToolPlan
    held: str = ""  # text not yet given out: a possible marker start, or an open block
    in_block: bool = False
    space: str = ""  # whitespace held back: dropped if a call follows
    calls: int = 0

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self.held += text
        while True:
            if self.in_block:
                end = self.held.find(CLOSE)
                if end < 0:
                    return out
                block, self.held, self.in_block = self.held[:end], self.held[end + len(CLOSE):], False
                self._block(block, CLOSE, out)
                continue
            start = self.held.find(OPEN)
            if start < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                             if OPEN.startswith(self.held[-k:])), 0)
                self._content(self.held[:len(self.held) - keep], out)
                self.held = self.held[len(self.held) - keep:]
                return out
            self._content(self.held[:start], out)
            self.held, self.in_block = self.held[start + len(OPEN):], True

    def flush(self) -> list[dict]:
        out: list[dict] = []
        if self.in_block:
            self._block(self.held, "", out)
        else:
            self._content(self.held, out)
        self.held, self.in_block = "", False
        if self.space and not self.calls:
            out.append({"content": self.space})
        self.space = ""
        return out

    def _content(self, text: str, out: list[dict]) -> None:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            out.append({"content": body})

    def _block(self, block: str, close: str, out: list[dict]) -> None:
        call = self._parse(block)
        if call is None:
            self._content(OPEN + block + close, out)
            return
        self.space = ""
        if self.calls and not self.plan.parallel:
            return
        out += _call_deltas(self.calls, *call)
        self.calls += 1

    def _parse(self, block: str) -> tuple[str, str] | None:
        """``(name, arguments JSON text)`` of a block, None if it is not a valid call."""
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("arguments"), dict):
            return None
        function = self.plan.function(obj.get("name")) if isinstance(obj.get("name"), str) else None
        if function is None:
            return None
        if function.strict and not conforms(obj["arguments"], function.schema):
            return None
        return function.name, json.dumps(obj["arguments"], ensure_ascii=False)


@dataclass
class NamedOutput(ToolOutput):
    """The output is the named function's arguments (forced by the schema): one call,
    its arguments streamed as they are generated. The finish reason stays the engine's
    ("stop"), as OpenAI answers a forced function and vLLM follows."""

    name: str
    calls: int = 0

    def feed(self, text: str) -> list[dict]:
        out = []
        if not self.calls:
            out = _call_deltas(0, self.name, "")[:1]
            self.calls = 1
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def flush(self) -> list[dict]:
        return self.feed("")

    def finish(self, reason: str) -> tuple[list[dict], str]:
        return self.flush(), reason


@dataclass
class RequiredOutput(ToolOutput):
    """The output is vLLM's ``[{"name", "parameters"}, ...]`` (forced by the schema): each
    element becomes a call as soon as it is complete. Text that does not parse (an output
    cut by ``max_tokens``) is content."""

    plan: ToolPlan
    held: str = ""
    opened: bool = False
    calls: int = 0

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self.held += text
        if self.opened and "}" not in text:
            return out  # an element can only be complete at a "}": no re-parse per token
        decoder = json.JSONDecoder()
        while True:
            rest = self.held.lstrip(" \t\r\n" + ("," if self.opened else ""))
            if not self.opened:
                if not rest.startswith("["):
                    return out
                rest, self.opened = rest[1:], True
                self.held = rest
                continue
            try:
                item, end = decoder.raw_decode(rest)
            except ValueError:
                self.held = rest
                return out
            name = item.get("name") if isinstance(item, dict) else None
            if self.plan.function(name) is None or not isinstance(item.get("parameters"), dict):
                self.held = rest
                return out
            out += _call_deltas(self.calls, name, json.dumps(item["parameters"], ensure_ascii=False))
            self.calls += 1
            self.held = rest[end:]

    def flush(self) -> list[dict]:
        rest = self.held.strip()
        self.held = ""
        return [] if rest in ("]", "") and self.opened else [{"content": rest}] if rest else []
