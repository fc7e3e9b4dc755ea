#!/usr/bin/env bash
# The device check: one command on a GPU machine, <= 6 minutes, everything it finds
# in $OUT (default ./gpu_check_out): summary.json (also printed), log.txt (every stage's output),
# gpu_tests.xml, device_tests.xml (junit), bench_gpu.json, fp8_fidelity/, bench_memory_cuda.json.
# See scripts/gpu/README.md.
#
#   bash scripts/gpu_check.sh                      # on the device (the repo root; carry .whl)
#   GPU_CHECK_DEVICES=cpu bash scripts/gpu_check.sh  # plumbing dry run on a CPU machine
#
# Stages: install the .whl/ wheels into /tmp/site; environment (nvidia-smi, torch, CUDA); the
# gpu-marked tests (tests/test_gpu.py); the device-parametrised tests' cuda ids; the CPU vs CUDA
# step benchmark; the real-vs-emulated FP8 fidelity; a 3-step FSDP2 training run at world size 1
# (torchrun, bf16 compute through FSDP's mixed precision); the peak memory of one update
# (bench_memory); vLLM as the sampler when a vLLM venv is there; the summary. Every stage runs under its own
# timeout inside one overall budget; a failing stage is recorded (rc, seconds) and the next runs.
# Exit status: 0 when every stage passed and no test failed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PY:-python3}
DEVICES=${GPU_CHECK_DEVICES:-cpu,cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-345}  # the whole check; the device tool allows 6 min for it
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---steps 3 --warmup 1 --prompts 8 --group 4 --new-tokens 32 --dtype fp32,bf16}
FP8_ARGS=${GPU_CHECK_FP8_ARGS:-}
FP8_DEVICE=cuda
[[ ",$DEVICES," == *",cuda,"* ]] || FP8_DEVICE=cpu
# bench_memory's grid: 4 and 64 rows (its growth target) of 16 + 128 and 16 + 512 tokens in
# 384-token micro-batches (2 rows or 1: alike at 4 and 64 rows), every mode, bf16 as the presets
MEM_ARGS=${GPU_CHECK_MEMORY_ARGS:---rows 4,64 --tokens 128,512 --micro-batch-tokens 384 --dtype bf16}
MEM_DEVICE=$FP8_DEVICE
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
STAGES=$WORK/stages.tsv
LOG=$OUT/log.txt
# this script's own files from an earlier run in the same $OUT
rm -rf "$OUT"/{summary.json,log.txt,gpu_tests.xml,device_tests.xml,bench_gpu.json} \
  "$OUT"/bench_memory_{cuda,cpu}.json \
  "$OUT"/fp8_fidelity "$OUT"/fp8_fidelity.tar.gz
: >"$STAGES"
: >"$LOG"
T0=$SECONDS
echo "gpu_check: OUT=$OUT devices=$DEVICES budget=${BUDGET}s ($(date -u +%FT%TZ))" | tee -a "$LOG"

record() {  # name rc seconds [note]
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$STAGES"
  echo "--- $1: rc=$2 ${3}s ${4:-} (elapsed $((SECONDS - T0))s)" | tee -a "$LOG"
}

# stage NAME MAX_S RESERVE_S CMD...: run CMD with a timeout of MAX_S, or less so that RESERVE_S
# seconds of the budget stay for the stages after it; output to $WORK/NAME.out and the log
stage() {
  local name=$1 max=$2 reserve=$3
  shift 3
  local left=$((BUDGET - (SECONDS - T0) - reserve))
  local limit=$((left < max ? left : max))
  if ((limit < 10)); then
    record "$name" skipped 0 "no time left in the ${BUDGET}s budget"
    return
  fi
  echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  local t=$SECONDS
  PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>&1
  local rc=$?
  cat "$WORK/$name.out" >>"$LOG"
  local note=""
  ((rc == 124 || rc == 137)) && note="timed out after ${limit}s"
  record "$name" "$rc" "$((SECONDS - t))" "$note"
}

# (a) the wheels the image lacks (scripts/gpu/wheels.sh downloads them into .whl/ beforehand)
t=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
  rc=$?
  if ((rc != 0)); then  # no pip: a pure-Python wheel installs by unzipping it (purelib only)
    echo "pip install failed (rc $rc): unzipping the wheels into /tmp/site" | tee -a "$LOG"
    mkdir -p /tmp/site && rc=0
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site >>"$LOG" 2>&1 || rc=$?; done
  fi
  record install $rc $((SECONDS - t)) "$(ls .whl | tr '\n' ' ')"
else
  msg="ERROR: no .whl/*.whl here: run 'bash scripts/gpu/wheels.sh' on a machine with PyPI and"
  msg+=" carry '.whl' to the device (hydra-core, omegaconf, submitit are not in its image)"
  echo "$msg" | tee -a "$LOG" >&2
  record install 2 0 "$msg"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false

# (b) the environment: nvidia-smi into the log, versions and capability into the summary
{ nvidia-smi || echo "nvidia-smi: not available"; } >>"$LOG" 2>&1
stage env 60 300 "$PY" scripts/gpu/summarize.py env --json "$WORK/env.json"
"$PY" - "$WORK/env.json" <<'EOF' || true
import json, sys
try:
    e = json.load(open(sys.argv[1]))
except Exception as exc:  # the env stage failed: its log says why
    sys.exit(f"env: unreadable ({exc})")
print(f"env: {e.get('gpu')} (sm {e.get('capability')}), torch {e.get('torch')}, "
      f"CUDA {e.get('cuda')}, python {e.get('python')}; {e.get('nvidia_smi')}")
EOF

# (c) tests: the gpu-marked file, then every other gpu-marked test: the `cuda` ids of the
# device-parametrised tests (conftest.py marks them gpu) and the gpu tests of other files
PYTEST=("$PY" -m pytest -v -rfE -p no:cacheprovider --continue-on-collection-errors)
stage gpu_tests 150 215 "${PYTEST[@]}" -m gpu --junitxml="$OUT/gpu_tests.xml" tests/test_gpu.py
stage device_tests 100 175 "${PYTEST[@]}" -m "gpu and not slurm and not recipe" \
  --ignore=tests/test_gpu.py --junitxml="$OUT/device_tests.xml" tests

# (d) the CPU vs CUDA step benchmark, then real FP8 vs emulated FP8
# shellcheck disable=SC2086  # BENCH_ARGS / FP8_ARGS are word lists
stage bench 150 120 "$PY" benchmarks/bench_gpu.py --devices "$DEVICES" $BENCH_ARGS \
  --json "$OUT/bench_gpu.json"
if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('harness.stats.fp8_fidelity') is None)"
then
  # shellcheck disable=SC2086
  stage fp8_fidelity 90 80 "$PY" -m harness.stats.fp8_fidelity --model smollm2-shaped \
    --n-layers 4 --sharpen 10 --device "$FP8_DEVICE" --dtype bf16 \
    --out "$OUT/fp8_fidelity" $FP8_ARGS  # 4 layers, logits ×10: tokens in every confidence bin
else
  record fp8_fidelity missing 0 "harness/stats/fp8_fidelity.py is not in this tree"
fi

# (e) FSDP2 at world size 1: torchrun, the trainer sharded (engine.fsdp=true: a process group of
# one), bf16 compute with fp32 master weights, a sharded checkpoint; the tiny Llama (no download)
stage fsdp 45 45 "$PY" -m torch.distributed.run --nproc_per_node=1 --master_port=29561 \
  -m harness.train out="$WORK/fsdp" hydra.run.dir="$WORK/fsdp" model=tiny-llama \
  ++task.digits=1 rollout.prompts_per_step=2 rollout.group_size=4 rollout.max_new_tokens=8 \
  steps=3 eval_n=4 eval_every=3 checkpoint_every=2 mechanism_batches=0 progress=false \
  engine.fsdp=true engine.device="$FP8_DEVICE" engine.trainer_dtype=bf16 \
  engine.sampler_dtype=bf16

# (f) the peak memory of one policy update (benchmarks/bench_memory.py; SmolLM2-shaped: no GGUF
# on the device): rows x tokens with and without micro-batching and activation checkpointing,
# torch.cuda.max_memory_allocated; its table, growth verdicts and bytes per token go to the log
# shellcheck disable=SC2086  # MEM_ARGS is a word list
stage bench_memory 60 5 "$PY" benchmarks/bench_memory.py --device "$MEM_DEVICE" \
  --model smollm2-shaped $MEM_ARGS --out "$OUT/bench_memory_$MEM_DEVICE.json"

# (g) vLLM as the sampler (tests/test_vllm.py: fp32 agreement with the trainer, seeding, weight
# sync), when a Python with vLLM is there: RATIOLAB_VLLM_PYTHON, else the venv `make vllm` builds
VLLM_PY=$("$PY" -m harness.sampling.vllm_engine 2>/dev/null)
if [ -n "$VLLM_PY" ] && [ -x "$VLLM_PY" ]; then
  stage vllm 120 5 "${PYTEST[@]}" -m slow tests/test_vllm.py -k "fp32 or seed or tied"
else
  record vllm absent 0 "no Python with vLLM (${VLLM_PY:-harness.sampling.vllm_engine failed}): set RATIOLAB_VLLM_PYTHON or carry a vLLM venv"
fi

# (h) the summary (standard library only), printed; at most 8 files under $OUT
"$PY" scripts/gpu/summarize.py summary --out "$OUT" --stages "$STAGES" --env "$WORK/env.json" \
  --tests gpu_tests,device_tests --logs "$WORK" >"$WORK/summary.out" 2>&1
src=$?
cat "$WORK/summary.out"
cat "$WORK/summary.out" >>"$LOG"
if (($(find "$OUT" -type f | wc -l) > 8)) && [ -d "$OUT/fp8_fidelity" ]; then
  tar -czf "$OUT/fp8_fidelity.tar.gz" -C "$OUT" fp8_fidelity && rm -rf "$OUT/fp8_fidelity"
  echo "more than 8 files under OUT: fp8_fidelity/ packed into fp8_fidelity.tar.gz" | tee -a "$LOG"
fi
rm -rf "$WORK"
echo "gpu_check: done in $((SECONDS - T0))s; files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
((src == 0)) || exit 1
"$PY" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" \
  "$OUT/summary.json"
