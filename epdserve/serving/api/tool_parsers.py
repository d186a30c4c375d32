"""Tool calls out of a choice's text as OpenAI chat ``delta`` dicts, streamed or merged into a
message from the same deltas, so both agree (docs/serving.md, Tool calling)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jsonschema
import referencing.exceptions

if TYPE_CHECKING:  # annotations only: tool_calls builds these parsers
    from epdserve.serving.api.tool_calls import FunctionDef

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format's markers


def conforms(value, schema: dict) -> bool:
    """False too when the schema cannot be applied (an unresolvable ``$ref``: none is fetched; too deep)."""
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    except (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError):
        return False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_deltas(index: int, name: str, arguments: str) -> list[dict]:
    head = {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]


def chat_deltas(tools: ToolOutput | None, text: str, finish: str | None,
                entries: list) -> tuple[list[dict], str | None, list] | None:
    """A streamed chat choice's new ``text`` as ``(deltas, finish reason, logprob entries)``:
    one content delta without ``tools``, else see :meth:`ToolOutput.stream`."""
    if tools is None:
        return ([{"content": text}] if text else []), finish, entries
    return tools.stream(text, finish, entries)


@dataclass
class ToolOutput:
    """One choice's parser (:meth:`~epdserve.serving.api.tool_calls.ToolPlan.output` picks it):
    :meth:`feed` each piece of text, :meth:`finish` once."""

    calls = 0
    held_entries: list = field(default_factory=list, kw_only=True)  # logprobs of text held back

    def stream(self, text: str, finish: str | None, entries: list) -> tuple[list[dict], str | None, list] | None:
        """``(deltas, finish reason, logprob entries)`` of a streamed piece; None while the
        text is held back, its ``entries`` then waiting for the next piece's."""
        deltas = self.feed(text)
        if finish is not None:
            more, finish = self.finish(finish)
            deltas += more
        if not deltas and finish is None:
            self.held_entries += entries
            return None
        entries, self.held_entries = self.held_entries + entries, []
        return deltas, finish, entries

    def feed(self, text: str) -> list[dict]:
        """Possibly none: text held until it is understood."""
        raise NotImplementedError

    def flush(self) -> list[dict]:
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
    """vLLM's ``hermes`` parser ("auto"): a block that is no valid call stays content, markers and
    all (vLLM); whitespace next to a call is dropped."""

    functions: dict[str, FunctionDef]  # the request's tools, by name
    parallel: bool = True
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
        if self.calls and not self.parallel:
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
        function = self.functions.get(obj.get("name")) if isinstance(obj.get("name"), str) else None
        if function is None:
            return None
        if function.strict and not conforms(obj["arguments"], function.schema):
            return None
        return function.name, json.dumps(obj["arguments"], ensure_ascii=False)


@dataclass
class NamedOutput(ToolOutput):
    """Arguments streamed as generated; the finish reason stays the engine's ("stop": OpenAI, vLLM)."""

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
    """vLLM's forced ``[{"name", "parameters"}, ...]``: a call per element once complete; what does
    not parse (cut by ``max_tokens``) is content."""

    functions: dict[str, FunctionDef]
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
            if not isinstance(name, str) or name not in self.functions or not isinstance(item.get("parameters"), dict):
                self.held = rest
                return out
            out += _call_deltas(self.calls, name, json.dumps(item["parameters"], ensure_ascii=False))
            self.calls += 1
            self.held = rest[end:]

    def flush(self) -> list[dict]:
        rest = self.held.strip()
        self.held = ""
        if not rest or (self.opened and rest == "]"):
            return []
        return [{"content": rest}]
