# The README's two commands: `make report` (the main job: build, then the CLI report) and
# `make test` (build, then the test suite). Both work on a fresh machine: the first run
# creates .venv and builds; later runs rebuild only when a source changed.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
SOURCES := setup.py pyproject.toml $(shell find prime_kernels -name '*.cu' -o -name '*.cuh' \
	-o -name '*.h' -o -name '*.cpp' -o -name 'kernels.toml')

.PHONY: report test lint format wheel

report: $(VENV)/.built
	$(PYTHON) -m prime_kernels

test: $(VENV)/.built
	$(PYTHON) -m pytest -q

lint: $(VENV)/.built
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	clang-format --dry-run --Werror $(shell find prime_kernels -name '*.cu' -o -name '*.cuh' \
		-o -name '*.cpp' -o -name '*.h')

format: $(VENV)/.built
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
	clang-format -i $(shell find prime_kernels -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' \
		-o -name '*.h')

# The release wheels (abi3, manylinux_2_28, sm_90a) into dist/, built without a GPU:
# x86_64, and aarch64 cross-compiled when its toolchain is here (scripts/build-wheels).
wheel: $(VENV)/.built
	VENV=$(VENV) bash scripts/build-wheels $(if $(shell command -v aarch64-linux-gnu-g++),--aarch64)

$(VENV)/.built: $(SOURCES) scripts/bootstrap
	VENV=$(VENV) bash scripts/bootstrap
	touch $@
