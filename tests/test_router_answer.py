"""The router's answer as stages, in process: a PD flow on fake workers and a fake clock
(see test_router_flows.py) owns its output state; each output goes once through the
choice (text, stop strings, logprobs), the tool-call parser and SSE framing, or into the
whole body; every flow ends in the request log."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from epdserve.serving.api import openai as api
from epdserve.serving.api.detokenizer import TextStream
from epdserve.serving.api.responses import SSE_DONE, StreamFramer
from epdserve.serving.api.tool_calls import ToolDef, ToolSettings, plan_tools
from epdserve.serving.router.answer import Answer, usage_counts
from epdserve.serving.router.choices import Choice
from epdserve.serving.router.events import WorkerFailed

from test_router_flows import KV, Setup, run, spin

CHAT = {"messages": [{"role": "user", "content": "x"}]}


class Log:
    """The request log: the trace record of every flow that ended."""

    def __init__(self):
        self.records = []

    def ended(self, flow):
        self.records.append(flow.end())


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def pd_choice(s: Setup, tokenizer, stops=(), tools=None) -> Choice:
    flow = s.flow(max_tokens=16)
    return Choice(0, flow, TextStream(tokenizer, flow.prompt_ids, list(stops)), None, tools=tools)


async def feed(s: Setup, outputs: list[list[int]], step_s: float = 0.01, reason: str = "length") -> None:
    """The prefill worker's first token (with its KV), then the decode worker's outputs, the
    last finished with ``reason``."""
    s.output("prefill-0", outputs[0], kv=KV)
    for k, ids in enumerate(outputs[1:], 1):
        await spin()
        s.clock.advance(step_s)
        last = k == len(outputs) - 1
        s.output("decode-0", ids, finished=last, reason=reason if last else None)
    await spin()


def test_the_flow_owns_its_output_state():
    """Tokens counted, gaps between outputs noted (fake clock), the last output's finish
    reason kept; a failure marks only a flow that had not finished."""
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow = s.flow()
        items = []

        async def read():
            async for item in flow.tokens():
                items.append(item)

        reader = asyncio.ensure_future(read())
        await spin()
        await feed(s, [[9], [10, 11], [12]], step_s=0.02)
        await reader
        assert [i[2] for i in items] == [None, None, "length"]
        assert flow.output_tokens == 4 and flow.finish_reason == "length"
        assert flow.itls_s == pytest.approx([0.02, 0.02])
        flow.fail(WorkerFailed("late", 503))
        assert flow.error is None
        flow.stop()
        assert flow.end().finish_reason == "stop"

    run(go())


def test_a_stop_string_ends_the_choice_and_its_flow(tokenizer):
    s = Setup("pd", "prefill-0", "decode-0")
    text = ids_of(tokenizer, " red green blue yellow")

    async def go():
        choice = pd_choice(s, tokenizer, stops=[" blue"])
        got = []

        async def read():
            async for item in choice.outputs():
                got.append(item)

        reader = asyncio.ensure_future(read())
        await spin()
        await feed(s, [[t] for t in text])
        await reader
        assert "".join(t for t, _, _ in got) == " red green" and got[-1][1] == "stop"
        assert choice.flow.finish_reason == "stop"

    run(go())


def test_a_streamed_answer_frames_each_output_once(tokenizer):
    """Role chunk with the first output, one content chunk per output, the finish reason on
    the last, the usage chunk, [DONE]; the flow ends in the log, closed."""
    s = Setup("pd", "prefill-0", "decode-0")
    text = ids_of(tokenizer, " one two three")
    body = api.ChatCompletionRequest(**CHAT, stream=True, stream_options={"include_usage": True})

    async def go():
        log = Log()
        choice = pd_choice(s, tokenizer)
        answer = Answer("chatcmpl-1", [choice], body, "chat", "m", log, str)
        events = []

        async def read():
            async for event in answer.events():
                events.append(event)

        reader = asyncio.ensure_future(read())
        await spin()
        await feed(s, [[t] for t in text])
        await reader
        assert events[-1] == SSE_DONE
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("content", "") for d in deltas[1:]) == " one two three"
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == len(text) and chunks[-1]["choices"] == []
        assert [r.finish_reason for r in log.records] == ["length"] and choice.flow.closed

    run(go())


def test_a_whole_answer_parses_tool_calls_once_and_ends_its_flows(tokenizer):
    s = Setup("pd", "prefill-0", "decode-0")
    tools = [ToolDef.model_validate({"type": "function", "function": {"name": "get_time"}})]
    plan = plan_tools(tools, "required", None, ToolSettings(True, "hermes", True))
    text = ids_of(tokenizer, '[{"name": "get_time", "parameters": {}}]')
    body = api.ChatCompletionRequest(**CHAT)
    request = SimpleNamespace(receive=asyncio.Event().wait)

    async def go():
        log = Log()
        choice = pd_choice(s, tokenizer, tools=plan.output())
        answer = asyncio.ensure_future(Answer("chatcmpl-1", [choice], body, "chat", "m", log, str).whole(request))
        await spin()
        await feed(s, [text[:2], text[2:]], reason="stop")
        out = json.loads((await answer).body)
        (got,) = out["choices"]
        assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
        assert got["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
        assert out["usage"]["completion_tokens"] == len(text) == usage_counts([choice])[1]
        assert [r.finish_reason for r in log.records] == ["stop"]

    run(go())


def test_the_framer_frames_chat_and_completion_chunks():
    chat = StreamFramer("c", "m", "chat", include_usage=True, continuous_usage=True)
    first = chat.chat(0, None, None, None, None)
    assert len(first) == 1 and chat.chat(0, None, None, None, None) == []
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    two = [json.loads(e.removeprefix("data: ")) for e in chat.chat(0, [{"content": "a"}, {"content": "b"}], "stop",
                                                                     {"content": []}, usage)]
    assert [c["choices"][0]["finish_reason"] for c in two] == [None, "stop"]
    assert [c["choices"][0]["logprobs"] for c in two] == [{"content": []}, None]
    assert all(c["usage"] == usage for c in two)
    plain = StreamFramer("c", "m", "completion", include_usage=False, continuous_usage=False)
    (chunk,) = plain.completion(1, "x", None, None, None)
    assert json.loads(chunk.removeprefix("data: "))["choices"][0] == {"index": 1, "text": "x", "logprobs": None,
                                                                      "finish_reason": None}
    assert plain.end(1, 2, 0) == [SSE_DONE]
