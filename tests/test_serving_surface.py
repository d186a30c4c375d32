"""vLLM's server surface: `serve MODEL`, /tokenize, /detokenize, /version, --served-model-name (404 for
another model), --api-key (401), --max-model-len, --generation-config, --dtype auto, the
flags serve shares with its workers (one definition each) and --config FILE.

One real deployment (colocated, started from a --config YAML file) serves a copy of the
default model's directory that carries a generation_config.json; the rest are checks of
the command line that start no worker, and unit tests."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import epdserve
from conftest import _stop, start_deployment
from epdserve.argtypes import config_argv, config_from, tokens_at_least
from epdserve.serving.launch.options import ServeOptions
from epdserve.model import loader
from epdserve.model.loader import ModelLoadError, auto_dtype, generation_defaults
from epdserve.model.tokenizer import chat_prompt_ids, load_tokenizer
from epdserve.serving import flags
from epdserve.serving.launch import launcher
from epdserve.serving.worker import engine_worker as worker
from epdserve.serving.api.openai import CompletionRequest
from epdserve.serving.router import surface
from epdserve.serving.router.app import served_model
from epdserve.serving.router.options import RouterOptions
from epdserve.serving.worker.setup import WORKER_FLAGS

KEY = "sk-test-surface"
NAMES = ["alpha", "beta"]
MAX_MODEL_LEN = 256
GEN_MAX_TOKENS = 3  # the generation_config.json's max_new_tokens
SERVE = [sys.executable, "-m", "epdserve", "serve", "--host", "127.0.0.1", "--port", "0"]


def model_copy(src, dst, generation_config: dict | None = None):
    """``dst``: the files of model directory ``src`` linked, plus a generation_config.json."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


@pytest.fixture(scope="module")
def surface_server(tmp_path_factory, model_info):
    tmp = tmp_path_factory.mktemp("surface")
    model = model_copy(model_info.path, tmp / "smol-gen",
                       {"max_new_tokens": GEN_MAX_TOKENS, "temperature": 0.0, "bos_token_id": 1})
    config = tmp / "serve.yaml"
    config.write_text(f"served_model_name: [{', '.join(NAMES)}]\napi-key: {KEY}\n"
                      f"max-model-len: {MAX_MODEL_LEN}\nenable-prefix-caching: false\ndtype: auto\n")
    # The model as vLLM's `serve MODEL` takes it: positional.
    dep = start_deployment("colocated", tmp, str(model), "--config", str(config), "--kv-cache-memory-mb", "64")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def client(dep, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.url + "/v1", api_key=key, max_retries=0, timeout=300)


def post(dep, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # json.dumps escapes a lone surrogate (httpx's own encoding cannot send one).
    return httpx.post(dep.url + path, content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json", **headers})


# ------------------------------------------------------------------- the deployment

def test_open_endpoints_and_api_key(surface_server):
    dep = surface_server
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(dep.url + path, timeout=30).status_code == 200, path
    assert httpx.get(dep.url + "/version", timeout=30).json() == {"version": epdserve.__version__}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                             ("POST", "/detokenize")):
            r = httpx.request(method, dep.url + path, headers=headers, json={"prompt": "hi"}, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                          "param": None, "code": "invalid_api_key"}}
            assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError) as info:
        client(dep, "wrong").completions.create(model=NAMES[0], prompt="hi", max_tokens=1)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    # dtype: auto (from the config file) reached the worker, which resolved it.
    assert f"--dtype auto: {auto_dtype(Path(client(dep).models.list().data[0].root))}" in dep.log_tail(10**7)


def test_bench_sends_openai_api_key(surface_server, tmp_path):
    """`epdserve bench` sends $OPENAI_API_KEY as a bearer token, as `vllm bench serve` and
    the openai SDK do; without it a keyed server's 401 is the error, not a traceback."""
    result = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "epdserve", "bench", "--base-url", surface_server.url, "--workload", "synthetic",
            "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--disable-tqdm",
            "--result-file", str(result)]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    ok = subprocess.run(argv, env=dict(env, OPENAI_API_KEY=KEY), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(result.read_text())["completed"] == 2
    bad = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "HTTP 401" in bad.stderr and "Traceback" not in bad.stderr


def test_served_names_models_root_and_404(surface_server, tokenizer):
    dep, api = surface_server, client(surface_server)
    cards = api.models.list().data
    assert [c.id for c in cards] == NAMES
    root = cards[0].root
    assert all(c.root == root and c.max_model_len == MAX_MODEL_LEN for c in cards)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (Path(root) / name).is_file(), name
    # Tools load the tokenizer from root (a directory, not the .gguf file).
    assert load_tokenizer(root)("Hello there").input_ids == tokenizer("Hello there").input_ids
    for name in NAMES:  # every name accepted, the first reported
        resp = api.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert resp.model == NAMES[0] and resp.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.body == {"message": info.value.body["message"], "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
    r = post(dep, "/tokenize", {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(surface_server, tokenizer):
    dep = surface_server
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓"
    r = post(dep, "/tokenize", {"model": NAMES[1], "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": MAX_MODEL_LEN,
                    "tokens": tokenizer(text).input_ids, "token_strs": None}
    back = post(dep, "/detokenize", {"model": NAMES[0], "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(body["tokens"])} == {"prompt": text}
    strs = post(dep, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(body["tokens"])

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = post(dep, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == chat_prompt_ids(tokenizer, messages) and chat["count"] == len(chat["tokens"])
    bare = post(dep, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]

    for bad, param in (({"tokens": [0, len(tokenizer)]}, "tokens"), ({"tokens": [-1]}, "tokens"),
                       ({"tokens": "abc"}, "tokens")):
        r = post(dep, "/detokenize", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for bad, param in (({}, "prompt"), ({"prompt": "a", "messages": messages}, "prompt"),
                       ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
                       ({"messages": messages, "tools": [{"type": "function"}]}, "tools"),
                       ({"messages": messages, "add_generation_prompt": True, "continue_final_message": True},
                        "continue_final_message"),
                       ({"prompt": "x" * (surface.MAX_TOKENIZE_CHARS + 1)}, "prompt"), ({"prompt": "\ud800"}, "prompt"),
                       ({"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
                       ({"messages": []}, "messages"), ({"prompt": 5}, "prompt")):
        r = post(dep, "/tokenize", bad)
        assert r.status_code == 400, (bad, r.text[:300])
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param, r.text


def test_max_model_len_and_generation_config_defaults(surface_server, tokenizer):
    dep, api = surface_server, client(surface_server)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=NAMES[0], prompt="Hello", max_tokens=MAX_MODEL_LEN)
    assert info.value.body["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in info.value.body["message"]
    long_ids = tokenizer("word " * 300).input_ids[:MAX_MODEL_LEN]
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=NAMES[0], prompt=long_ids, max_tokens=1)

    # generation_config.json: max_new_tokens 3 and temperature 0 where the request is silent.
    prompt, extra = "Once upon a time", {"ignore_eos": True}
    default = api.completions.create(model=NAMES[0], prompt=prompt, extra_body=extra)
    assert default.usage.completion_tokens == GEN_MAX_TOKENS and default.choices[0].finish_reason == "length"
    greedy = api.completions.create(model=NAMES[0], prompt=prompt, max_tokens=GEN_MAX_TOKENS, temperature=0,
                                    extra_body=extra)
    assert default.choices[0].text == greedy.choices[0].text
    chat = api.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "Hi"}],
                                       extra_body=extra)
    assert chat.usage.completion_tokens == GEN_MAX_TOKENS
    own = api.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "Hi"}],
                                      max_completion_tokens=5, extra_body=extra)
    assert own.usage.completion_tokens == 5  # the request's own value wins


# ------------------------------------------------------------ the command line, no worker

def run_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=timeout)


def test_serve_refuses_bad_values_before_any_worker(tmp_path):
    start = time.monotonic()
    proc = run_serve("--dtype", "bf16")
    assert proc.returncode == 2 and "--dtype" in proc.stderr and "'bf16'" in proc.stderr, proc.stderr
    assert "started worker" not in proc.stderr and time.monotonic() - start < 60
    (tmp_path / "bad.yaml").write_text("max-num-seqs: 4\nno-such-flag: 1\n")
    proc = run_serve("--config", str(tmp_path / "bad.yaml"))
    assert proc.returncode == 2 and "unknown option 'no-such-flag'" in proc.stderr, proc.stderr
    (tmp_path / "typed.yaml").write_text("block_size: 0\n")
    proc = run_serve("--config", str(tmp_path / "typed.yaml"))
    assert proc.returncode == 2 and "--block-size" in proc.stderr and "'0'" in proc.stderr, proc.stderr
    proc = run_serve("--max-model-len", "100000", "--startup-timeout", "30")
    assert proc.returncode == 2 and "--max-model-len 100000" in proc.stderr, proc.stderr
    assert "started worker" not in proc.stderr
    proc = run_serve("/models/a", "--model", "/models/b")
    assert proc.returncode == 2 and ("MODEL '/models/a' and --model '/models/b' name different models; "
                                     "give one") in proc.stderr, proc.stderr


def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    serve, work = argparse.ArgumentParser(), argparse.ArgumentParser()
    launcher.add_arguments(serve)
    worker.add_arguments(work)
    return serve, work


def test_serve_passes_worker_flags_as_the_worker_parses_them():
    serve, work = parsers()
    given = ["--dtype", "auto", "--block-size", "32", "--max-num-seqs", "3", "--enable-chunked-prefill",
             "--no-enable-prefix-caching", "--kv-transfer-dtype", "int8", "--kv-layer-pipeline", "--model", "m"]
    args = serve.parse_args(given)
    wargs = work.parse_args(launcher.worker_command(config_from(ServeOptions, args), "prefill", "p-0", [0], "ipc://e", "ipc://c")[4:])
    for flag in (flags.MODEL_FLAG, *WORKER_FLAGS):
        assert getattr(wargs, flag.dest) == getattr(work.parse_args(["--role", "decode", "--router", "e", "--bind",
                                                                     "c", "--worker-id", "w", *given]), flag.dest)
    # Nothing given: nothing passed, the worker's own defaults hold.
    assert launcher.worker_command(config_from(ServeOptions, serve.parse_args([])), "colocated", "c-0", [0], "e", "c")[-2:] == ["--cores", "0"]
    # --decode-dtype is the decode workers' --dtype.
    argv = launcher.worker_command(config_from(ServeOptions, serve.parse_args(["--decode-dtype", "bfloat16"])), "decode",
                                  "d-0", [1], "e", "c")
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    # --decode-kv-cache-dtype is the decode workers' --kv-cache-dtype, not the prefill workers'.
    args = config_from(ServeOptions, serve.parse_args(["--decode-kv-cache-dtype", "bfloat16"]))
    argv = launcher.worker_command(args, "decode", "d-0", [1], "e", "c")
    assert argv[argv.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert "--kv-cache-dtype" not in launcher.worker_command(args, "prefill", "p-0", [0], "e", "c")


def test_vllm_flag_names_and_bad_numbers(capsys):
    serve, work = parsers()
    args = serve.parse_args(["-dp", "3", "--limit-mm-per-prompt", '{"image": 2, "video": 0}'])
    assert (args.workers, args.limit_images_per_prompt) == (3, 2)
    args = serve.parse_args(["--data-parallel-size", "2", "--limit-mm-per-prompt", "image=5"])
    assert (args.workers, args.limit_images_per_prompt) == (2, 5)
    # The vLLM form does not hide the default of epdserve's own flag.
    assert serve.parse_args([]).limit_images_per_prompt == serve.get_default("limit_images_per_prompt") > 0
    for parser, argv, named in (
            (serve, ["--limit-mm-per-prompt", '{"video": 1}'], "images only, not video"),
            (serve, ["--limit-mm-per-prompt", '{"image": -1}'], "image's count -1"),
            (serve, ["--limit-mm-per-prompt", "{image: 1}"], "not a JSON object"),
            (serve, ["--limit-mm-per-prompt", '{"text": 1}'], "unknown modality 'text'"),
            (serve, ["--workers", "0"], "--workers"), (serve, ["--decode-workers", "-1"], "--decode-workers"),
            (serve, ["--max-workers", "0"], "--max-workers"),
            (serve, ["--startup-timeout", "-1"], "--startup-timeout"), (serve, ["--request-timeout", "nan"], "'nan'"),
            (serve, ["--worker-timeout", "0"], "--worker-timeout"), (serve, ["--http-body-timeout", "inf"], "'inf'"),
            (serve, ["--http-header-timeout", "-2"], "--http-header-timeout"),
            (work, ["--kv-ttl", "0"], "--kv-ttl"), (work, ["--kv-transfer-timeout", "-1"], "--kv-transfer-timeout")):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and named in err, (argv, err)


def test_config_file_keys_types_and_precedence(tmp_path):
    serve, _ = parsers()
    serve.add_argument("--config")
    path = tmp_path / "c.yaml"
    path.write_text("max_num_seqs: 8\nserved-model-name: [a, b]\nenable-prefix-caching: false\n"
                    "enable_chunked_prefill: true\nkv-layer-pipeline: false\nport: 9\n")
    args = serve.parse_args(config_argv(serve, ["--config", str(path), "--port", "7"]))
    assert (args.max_num_seqs, args.served_model_name, args.enable_prefix_caching) == (8, ["a", "b"], False)
    assert (args.enable_chunked_prefill, args.kv_layer_pipeline, args.port) == (True, False, 7)  # command line wins
    for text, error in (("- a\n", "expected a mapping"), ("block-size: [1, 2]\n", "takes one value"),
                        ("kv-layer-pipeline: 3\n", "is a switch"), ("config: x.yaml\n", "unknown option 'config'"),
                        ("a: [\n", "cannot read it as YAML")):
        path.write_text(text)
        with pytest.raises(SystemExit) as info:
            config_argv(serve, ["--config", str(path)])
        assert info.value.code == 2, text


# ---------------------------------------------------------------------------- units

def test_human_readable_token_counts():
    parse = tokens_at_least(1)
    assert [parse(t) for t in ("4096", "4k", "4K", "25.6k", "1M", "1m")] == [4096, 4000, 4096, 25600, 2**20, 10**6]
    for bad in ("0", "-1", "1.5", "0.0001k", "x", "k", "4kk", "", "infk", "nank"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_api_keys_from_flag_then_environment(monkeypatch):
    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert surface.api_keys(None) == ()
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert surface.api_keys(None) == ("v",)
    monkeypatch.setenv("EPDSERVE_API_KEY", "e")
    assert surface.api_keys(None) == ("e",) and surface.api_keys(["k1", "k2"]) == ("k1", "k2")
    guard = surface.APIKeyGuard(None, ("k1", "k2"))
    assert guard.authorized([(b"authorization", b"Bearer k2")]) and guard.authorized([(b"Authorization", b"bearer k1")])
    for value in (b"Bearer k3", b"k1", b"Bearer", b"", b"Bearer k1 "):
        assert guard.authorized([(b"authorization", value)]) == (value == b"Bearer k1 "), value


def test_generation_config_sources(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    assert generation_defaults("auto", model) == {}
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 100, "repetition_penalty": 1.05,
         "do_sample": True, "eos_token_id": 2, "min_p": None}))
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100, "repetition_penalty": 1.05}
    assert generation_defaults("auto", model) == expected
    assert generation_defaults("vllm", model) == {}
    assert generation_defaults(str(model), tmp_path) == expected
    with pytest.raises(ModelLoadError, match="no generation_config.json"):
        generation_defaults(str(tmp_path), model)
    assert surface.checked_defaults(expected, "auto") == expected
    assert surface.checked_defaults({"top_k": 0, "temperature": 1}, "auto") == {"top_k": -1, "temperature": 1.0}
    kept = surface.checked_defaults({"min_p": 0.1, "top_k": 5}, "auto")  # min_p only once requests have it
    assert kept["top_k"] == 5 and ("min_p" in kept) == ("min_p" in CompletionRequest.model_fields)
    with pytest.raises(ModelLoadError, match="temperature=5"):
        surface.checked_defaults({"temperature": 5}, "auto")


def test_dtype_auto(model_info, tmp_path, monkeypatch):
    assert auto_dtype(model_info.path) == "float32"  # a quantized GGUF: its kernels compute in float32
    plain = model_copy(model_info.path, tmp_path / "plain")
    (plain / "quantized").unlink()
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert auto_dtype(plain) == "bfloat16" and auto_dtype(model_info.path, "bf16") == "bfloat16"
    assert auto_dtype(model_info.path, "f32") == auto_dtype(plain, "q4_1+bf16") == "float32"
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2", "fma"})
    assert auto_dtype(plain) == "float32"


def test_served_model_names_and_context(model_info):
    model = served_model(RouterOptions())
    assert model.accepts(model.name) and model.accepts(str(model.path)) and not model.accepts("other")
    model = served_model(RouterOptions(max_model_len=100, served_model_name=["x", "y", "x"]))
    assert (model.name, model.served_names, model.max_model_len) == ("x", ("x", "y"), 100)
    assert model.accepts("y") and not model.accepts(model_info.name)
    with pytest.raises(ModelLoadError, match="--max-model-len"):
        served_model(RouterOptions(max_model_len=model_info.max_model_len + 1))
