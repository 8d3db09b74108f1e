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

# An abi3 wheel for sm_90a, built without a GPU.
wheel: $(VENV)/.built
	PRIME_KERNELS_REQUIRE=1 $(PYTHON) -m pip wheel --no-build-isolation --no-deps -w dist .

$(VENV)/.built: $(SOURCES) scripts/bootstrap
	VENV=$(VENV) bash scripts/bootstrap
	touch $@
