"""Tool calling: the Hermes parser whole and streamed (split at every character), vLLM's
schemas for required / named tool_choice, the request checks, and real colocated servers
driven with the ``openai`` SDK (a tool-call round trip, streamed calls, 400s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

from conftest import _stop, start_deployment
from epdserve.model.tokenizer import chat_prompt_text, load_tokenizer, template_renders_tools
from epdserve.serving.api.logprobs import LogprobsFormatter
from epdserve.serving.api.openai import ChatCompletionRequest
from epdserve.serving.api.responses import StreamFramer
from epdserve.serving.api.errors import APIError
from epdserve.serving.api.tool_calls import NamedToolChoice, ToolDef, ToolPlan, ToolSettings, plan_tools, tool_chars
from epdserve.serving.api.tool_parsers import NamedOutput, chat_deltas

pytestmark = pytest.mark.api

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "templates" / "hermes_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(TIME)]
ENABLED = ToolSettings(auto=True, parser="hermes", template_tools=True)


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def merged(output, pieces: list[str], reason: str = "stop") -> tuple[dict, str]:
    """Feed ``pieces`` one by one and merge the deltas as an OpenAI client does."""
    deltas = [d for p in pieces for d in output.feed(p)]
    more, reason = output.finish(reason)
    content, calls = "", {}
    for d in deltas + more:
        assert set(d) <= {"content", "tool_calls"}
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            if "id" in c:
                assert c["index"] == len(calls) and c["id"].startswith("call_") and c["type"] == "function"
                calls[c["index"]] = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            else:
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}, reason


def whole(plan: ToolPlan, text: str, reason: str = "stop") -> tuple[dict, str]:
    message, reason = plan.output().message(text, reason)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    return {"content": message["content"] or "", "calls": calls}, reason


AUTO = ToolPlan("auto", TOOLS)
CASES = [
    ("just text, no calls \n", "just text, no calls \n", []),
    ("Let me check.\n" + call("get_weather", {"city": "Paris", "unit": "celsius"}) + "\n",
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (call("get_time", {}) + "\n" + call("get_weather", {"city": "Oslo", "unit": "celsius"}),
     "", [("get_time", {}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("a < b and <tool_ca are text " + call("get_time", {}) + " done",
     "a < b and <tool_ca are text done", [("get_time", {})]),
    ("bad: <tool_call>{not json}</tool_call>", "bad: <tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("cut " + call("get_time", {})[:-len("</tool_call>")], "cut", [("get_time", {})]),
    ("cut <tool_call>{\"name\": \"get_ti", "cut <tool_call>{\"name\": \"get_ti", []),
    ("ends with <tool", "ends with <tool", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_whole_and_streamed_at_every_split(text, content, calls):
    """The whole parse gives the expected content and calls; feeding the text in two
    pieces split at every character, or one character at a time, gives the same."""
    expected = {"content": content, "calls": [{"name": n, "arguments": json.dumps(a)} for n, a in calls]}
    got, reason = whole(AUTO, text)
    assert got == expected
    assert reason == ("tool_calls" if calls else "stop")
    for k in range(len(text) + 1):
        assert merged(AUTO.output(), [text[:k], text[k:]]) == (expected, reason), k
    assert merged(AUTO.output(), list(text)) == (expected, reason)


def test_hermes_markup_never_streams_as_content():
    """No piece of a valid call's markers reaches a content delta, whatever the split."""
    text = "Sure." + call("get_time", {}) + "Bye."
    out = AUTO.output()
    streamed = "".join(d.get("content", "") for ch in text for d in out.feed(ch))
    streamed += "".join(d.get("content", "") for d in out.finish("stop")[0])
    assert streamed == "Sure.Bye." and "<" not in streamed


def test_hermes_length_cut_and_parallel_and_strict():
    """A call cut by max_tokens keeps finish_reason "length"; parallel_tool_calls false
    keeps the first call only; a strict tool's call whose arguments break its schema stays
    content."""
    text = call("get_time", {}) + call("get_weather", {"city": "Rome", "unit": "celsius"})
    assert whole(AUTO, text, "length")[1] == "length"
    single, reason = whole(ToolPlan("auto", TOOLS, parallel=False), text)
    assert [c["name"] for c in single["calls"]] == ["get_time"] and reason == "tool_calls"
    strict = ToolDef.model_validate({"type": "function", "function": {**WEATHER["function"], "strict": True}})
    bad = call("get_weather", {"city": "Rome", "unit": "kelvin"})
    assert whole(ToolPlan("auto", [strict]), bad) == ({"content": bad, "calls": []}, "stop")


def test_required_and_named_outputs():
    """Required: vLLM's array of {name, parameters} becomes calls, element by element,
    whatever the split; the schema validates such arrays. Named: the whole output is the
    arguments, streamed as they come, and the finish reason stays "stop" (OpenAI's and vLLM's)."""
    plan = ToolPlan("required", TOOLS)
    items = [{"name": "get_weather", "parameters": {"city": "Lima", "unit": "celsius"}},
             {"name": "get_time", "parameters": {}}]
    text = json.dumps(items)
    schema = json.loads(plan.guided_spec().value)
    jsonschema.validate(items, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": 3}}], schema)
    expected = ({"content": "", "calls": [{"name": i["name"], "arguments": json.dumps(i["parameters"])}
                                          for i in items]}, "tool_calls")
    assert whole(plan, text) == expected
    for k in range(len(text) + 1):
        assert merged(plan.output(), [text[:k], text[k:]]) == expected, k
    assert json.loads(ToolPlan("required", TOOLS, parallel=False).guided_spec().value)["maxItems"] == 1
    cut = text[:30]
    assert whole(plan, cut, "length") == ({"content": cut[1:], "calls": []}, "length")

    named = ToolPlan("named", TOOLS, named="get_weather")
    assert json.loads(named.guided_spec().value) == WEATHER["function"]["parameters"]
    args = '{"city": "Kyiv", "unit": "celsius"}'
    assert merged(NamedOutput("get_weather"), list(args)) == (
        {"content": "", "calls": [{"name": "get_weather", "arguments": args}]}, "stop")


def test_streamed_chunks_keep_the_logprobs_of_held_text():
    """While the parser holds text back (a possible call), its tokens' logprobs wait and
    come with the next chunk: every token's entry is sent once, in order; the last chunk
    carries finish_reason "tool_calls"."""
    tools, logprobs, framer = AUTO.output(), LogprobsFormatter("chat", str), StreamFramer("chatcmpl-1", "m", "chat",
                                                                                          False, False)
    framer.announced.add(0)  # no role chunk
    pieces = ["Hi ", "<tool", "_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>", ""]
    steps = [chat_deltas(tools, p, "stop" if k == len(pieces) - 1 else None, [(k, -0.5, [])])
             for k, p in enumerate(pieces)]
    chunks = [json.loads(e.removeprefix("data: ")) for step in steps if step is not None
              for e in framer.chat(0, step[0], step[1], logprobs(step[2]), None)]
    sent = [e["token"] for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert sent == [str(k) for k in range(len(pieces))]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi"


def test_plan_checks():
    """The request rules: tool_choice without tools, an unknown named function, duplicate
    names, a template without a tool format, "auto" without the server's flags."""
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [((None, "required", ENABLED), "tool_choice"),
             ((TOOLS, NamedToolChoice.model_validate(named), ENABLED), "tool_choice"),
             ((TOOLS + TOOLS[:1], "auto", ENABLED), "tools"),
             ((TOOLS, "none", ToolSettings(auto=True, parser="hermes")), "tools"),
             ((TOOLS, None, ToolSettings(template_tools=True)), "tool_choice")]
    for (tools, choice, settings), param in cases:
        with pytest.raises(APIError) as err:
            plan_tools(tools, choice, None, settings)
        assert err.value.param == param
    assert plan_tools(None, "none", None, ENABLED) is None
    assert plan_tools(TOOLS, None, None, ENABLED).mode == "auto"
    assert plan_tools(TOOLS, "required", False, ToolSettings(template_tools=True)).parallel is False
    with pytest.raises(ValueError, match="JSON Schema"):
        ToolDef.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}})
    with pytest.raises(ValueError):
        ToolDef.model_validate({"type": "function", "function": {"name": "has space"}})


def test_template_renders_the_round_trip(tokenizer, model_info):
    """The example template: tools in the system turn, the assistant's calls as Hermes
    blocks, a tool result as a "tool" turn in <tool_response>; without tools it renders as
    the model's own template."""
    tok = load_tokenizer(model_info.path, TEMPLATE.read_text())
    assert template_renders_tools(tok) and not template_renders_tools(tokenizer)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = chat_prompt_text(tok, messages, tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER["function"]) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n' + call("get_weather", {"city": "Paris", "unit": "celsius"}) + "<|im_end|>"
            in text)
    assert "<|im_start|>tool\n<tool_response>\n21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert chat_prompt_text(tok, messages[:1]) == chat_prompt_text(tokenizer, messages[:1])


# ----------------------------------------------------------------------- real servers

@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A colocated deployment with the Hermes template and auto tool choice on."""
    dep = start_deployment("colocated", tmp_path_factory.mktemp("serve-tools"), "--chat-template", str(TEMPLATE),
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield dep
    finally:
        _stop(dep.proc)


ASK = [{"role": "system", "content": "You call functions to answer."},
       {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def stream_message(client, **kw) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) of a streamed chat, its deltas merged as a client does."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for c in delta.tool_calls or ():
                if c.id is not None:
                    assert c.index not in calls and c.type == "function"
                    calls[c.index] = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments or ""}
                else:
                    assert c.function.name is None
                    calls[c.index]["arguments"] += c.function.arguments
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_tool_choice_streams_as_it_answers(tool_server):
    """tool_choice "auto" (greedy): the streamed answer, merged, equals the non-streamed
    one, content and calls alike, and no tool-call markup reaches the content."""
    client = tool_server.openai()
    kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice="auto",
              max_tokens=40, temperature=0)
    resp = client.chat.completions.create(**kw)
    msg = resp.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or ()]
    content, streamed, finish = stream_message(client, **kw)
    assert (content or None, [{k: c[k] for k in ("name", "arguments")} for c in streamed], finish) == (
        msg.content or None, calls, resp.choices[0].finish_reason)
    assert "<tool_call>" not in content
    for c in calls:
        assert isinstance(json.loads(c["arguments"]), dict)


def test_tool_choice_none_renders_tools_and_answers_text(tool_server):
    """tool_choice "none": the tools are in the prompt (more prompt tokens), the answer is text."""
    client = tool_server.openai()
    kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kw)
    none = client.chat.completions.create(tools=[WEATHER], tool_choice="none", **kw)
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


def test_tool_requests_refused(tool_server, colocated_server):
    """400 naming the field: a named function not in tools, tool_choice without tools, a
    bad parameters schema, an unknown key in a tool, a tool message without its call id,
    "required" with another structured-output constraint;
    with the model's own template (no tool format), tools and tool messages."""
    client = tool_server.openai()
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    cases = [(dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
              "tool_choice", "not in tools"),
             (dict(tool_choice="required"), "tool_choice", "`tools` must be set"),
             (dict(tools=[bad_schema]), "tools", "JSON Schema"),
             (dict(tools=[{"type": "function", "function": {"name": "f", "paramters": {}}}]), "tools", "paramters"),
             (dict(messages=ASK + [{"role": "tool", "content": "x"}]), "messages", "tool_call_id"),
             (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
              "tool_choice", "cannot be combined with response_format")]
    for kw, param, words in cases:
        kw = {"messages": ASK, **kw}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, **kw)
        body = err.value.body
        assert body["param"] == param and words in body["message"], (kw, body)
    plain = colocated_server.openai()
    done = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    for kw, param in [(dict(messages=ASK, tools=[WEATHER]), "tools"),
                      (dict(messages=ASK + [done, {"role": "tool", "tool_call_id": "call_1", "content": "9:00"}]),
                       "messages")]:
        with pytest.raises(openai.BadRequestError) as err:
            plain.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, **kw)
        assert err.value.body["param"] == param and "--chat-template" in err.value.body["message"]


def test_named_tool_call_round_trip(tool_server):
    """A named function (forced by structured output): one call whose arguments validate
    against its parameters, finish_reason "stop" (OpenAI's, vLLM's); the streamed deltas
    merge to the same call; the assistant's message (the SDK's own object) and the tool's
    result go back through the template and get a text answer."""
    client = tool_server.openai()
    kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, streamed, finish = stream_message(client, **kw)
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", call.function.arguments)]

    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", tools=[WEATHER, TIME], tool_choice="none", max_tokens=12, temperature=0,
        messages=ASK + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}])
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_required_tool_calls(tool_server):
    """tool_choice "required": at least one call, each of a given tool with arguments valid
    against its parameters, finish_reason "tool_calls"; with parallel_tool_calls false, one."""
    client = tool_server.openai()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for parallel in (True, False):
        choice = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="required", parallel_tool_calls=parallel,
                                                max_tokens=80, temperature=0).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert parallel or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_serve_refuses_bad_tool_options(tmp_path):
    """serve exits 2 before any worker starts, naming the problem: a --chat-template that
    is no file, one that does not render, --enable-auto-tool-choice without a parser."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    for extra, words in [(["--chat-template", str(tmp_path / "none.jinja")], "no such file"),
                         (["--chat-template", str(broken)], "chat template failed"),
                         (["--enable-auto-tool-choice"], "--tool-call-parser")]:
        proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--port", "0", *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and words in proc.stderr, (extra, proc.stderr[-2000:])
        assert "worker" not in proc.stdout


def test_tool_chars_bound_the_rendered_prompt(tokenizer, model_info):
    """The characters tool_chars counts never exceed what the template renders of them."""
    tok = load_tokenizer(model_info.path, TEMPLATE.read_text())
    messages = [{"role": "user", "content": ""},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{ "city" :  "Zürich",  "unit": "celsius" }'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": ""}]
    body = ChatCompletionRequest(messages=messages, tools=[WEATHER, TIME])
    plain = chat_prompt_text(tok, [{"role": m["role"], "content": ""} for m in messages])
    full = chat_prompt_text(tok, [m.as_template_dict() for m in body.messages], tools=[WEATHER, TIME])
    assert 0 < tool_chars(body) <= len(full) - len(plain)


@pytest.mark.timeout(1800)  # two deployments start: minutes each when the cores are shared
def test_named_tool_call_in_pd_equals_colocated(tool_server, tmp_path):
    """PD (1P1D, the forcing grammar continued by the decode worker): the same greedy
    call as colocated, streamed and not."""
    kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    want = tool_server.openai().chat.completions.create(**kw).choices[0].message.tool_calls[0].function
    pd = start_deployment("pd", tmp_path, "--chat-template", str(TEMPLATE))
    try:
        client = pd.openai()
        got = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function
        assert (got.name, got.arguments) == (want.name, want.arguments)
        _, streamed, finish = stream_message(client, **kw)
        assert [(c["name"], c["arguments"]) for c in streamed] == [(want.name, want.arguments)] and finish == "stop"
    finally:
        _stop(pd.proc)
