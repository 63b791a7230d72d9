#!/usr/bin/env bash
# Create .venv and install train_2048's dependencies. Safe to re-run.
#   bash setup.sh          # CPU set when no NVIDIA GPU is visible
#   bash setup.sh --cpu    # force the CPU set (the CPU demo, tests, CI)
set -euo pipefail
cd "$(dirname "$0")"

mode=auto
for arg in "$@"; do
  case "$arg" in
    --cpu) mode=cpu ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

if [ "$mode" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    mode=gpu
  else
    mode=cpu
  fi
fi

if [ "$mode" = gpu ]; then
  echo "setup.sh: an NVIDIA GPU is visible, but the GPU install path is not written yet." >&2
  echo "setup.sh: run 'bash setup.sh --cpu' for the CPU demo and tests; the GPU set is listed in requirements.txt." >&2
  exit 2
fi

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "setup.sh: Python >= 3.11 is needed (found $("$python" --version 2>&1))" >&2; exit 2; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, alone, so nothing below pulls a newer multi-GB CUDA build (pip finds the CPU wheel
# in its find-links folder where the machine has one).
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -r requirements-cpu.txt
.venv/bin/python - <<'PY'
import torch, transformers, trl, peft
print(f"train_2048 CPU set ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, peft {peft.__version__}")
PY
