#!/usr/bin/env bash
# The GPU set for a GPU machine without internet: packed where there is internet, installed there, checked anywhere.
#   bash bench/gpu_set.sh pack [PACKAGE ...]  # with internet and this project's .venv: writes .gpu-wheels/ (the
#                                             # wheels the GPU machine lacks, libseccomp's Debian package) and
#                                             # .gpu-tokenizer.tar.gz (GPT-OSS's tokenizer) into the project folder
#   bash bench/gpu_set.sh install             # on the GPU machine, in the copied project: the wheels into python3
#   bash bench/gpu_set.sh check               # one line: the versions and the GPU, or what is missing (exit 1)
# The GPU machine must have a CUDA build of torch (2.11 to 2.14) and transformers 5.17.0 already, as PyTorch's GPU
# containers and images have torch; `pack` fetches the rest of the GPU set (requirements.txt's pins) and the packages
# Unsloth imports beyond it. Name what else the machine lacks: `pack transformers==5.17.0 accelerate==1.15.0`.
# The wheels are for the GPU machine's Python and processor: TARGET_PYTHON (default 3.12), TARGET_ARCH (x86_64 or
# aarch64, default x86_64), TARGET_CUDA (the major CUDA version of its torch: 13 or 12, default 13; bitsandbytes
# keeps that library alone, so the folder stays near 50 MB). PYTHON: the interpreter (pack: .venv/bin/python;
# install and check: python3). bench/gpu_matrix.py runs `install` itself when .gpu-wheels/ is in the project.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "gpu_set.sh: $*" >&2; exit 2; }
verb=${1:-}
[ $# -gt 0 ] && shift
wheels=.gpu-wheels
tokenizer=.gpu-tokenizer.tar.gz

# One line: the GPU set's versions and the GPU it sees, or what is missing.
check() {
  "${PYTHON:-python3}" - <<'PY'
import importlib.metadata as metadata
import importlib.util
import sys

names = ("torch", "transformers", "trl", "peft", "bitsandbytes", "unsloth", "unsloth_zoo", "datasets", "pyseccomp")
missing = [name for name in names if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu_set.sh: missing {', '.join(missing)}: `bash setup.sh` with internet, else `bash bench/gpu_set.sh "
             "pack` on a machine with internet and `install` here")
import torch  # noqa: E402

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print("gpu set:", "python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, gpu or "no GPU",
      *(f"{name} {metadata.version(name)}" for name in names[1:-1]))
if gpu is None:
    sys.exit("gpu_set.sh: torch sees no GPU" + ("" if torch.version.cuda else ": it is a CPU build"))
PY
}

# The requirement as requirements.txt pins it, else the bare name (the latest).
pin() {
  local line
  line=$(grep -iE "^$1([=<>!~ ]|$)" requirements.txt | head -1 | sed 's/[[:space:]]*#.*//' || true)
  echo "${line:-$1}"
}

pack() {
  local python=${PYTHON:-.venv/bin/python} arch=${TARGET_ARCH:-x86_64} cuda=${TARGET_CUDA:-13}
  [ -x "$python" ] || die "no $python: run 'bash setup.sh --cpu' first (the CPU set builds the tokenizer)"
  case "$arch" in x86_64) deb_arch=amd64 ;; aarch64) deb_arch=arm64 ;; *) die "TARGET_ARCH $arch: x86_64 or aarch64" ;; esac
  # What a PyTorch image lacks of the GPU set, found by importing the project's GPU path on one (2026-11-23).
  local packages=(unsloth unsloth_zoo trl peft bitsandbytes datasets pyseccomp tyro docstring_parser shtab typeguard
                  dill multiprocess torchao cut_cross_entropy msgspec hf_transfer json5 nest_asyncio structlog xxhash "$@")
  local platforms=() tag
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${tag}_$arch")
  done
  local part=$wheels.part
  rm -rf "$part"
  mkdir -p "$part"
  for package in "${packages[@]}"; do
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" \
      --implementation cp "${platforms[@]}" --platform any --dest "$part" "$(pin "$package")" ||
      die "no wheel of $(pin "$package") for Python ${TARGET_PYTHON:-3.12} on $arch"
  done
  # bitsandbytes ships a library per backend and version (CUDA 11.8 to 13.x, ROCm, XPU): keep CUDA $cuda's and the CPU's.
  local wheel unpacked
  for wheel in "$part"/bitsandbytes-*.whl; do
    unpacked=$(mktemp -d)
    "$python" -m zipfile -e "$wheel" "$unpacked"
    find "$unpacked" -name 'libbitsandbytes_*.so' ! -name "*cuda$cuda*" ! -name '*cpu*' -delete
    "$python" - "$unpacked" "$wheel" <<'PY'
import base64, hashlib, sys, zipfile
from pathlib import Path

# A wheel again, with a RECORD that lists what is left (pip checks each file against it).
folder, wheel = Path(sys.argv[1]), sys.argv[2]
record = next(folder.glob("*.dist-info")) / "RECORD"
rows = []
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p != record):
        data, name = path.read_bytes(), path.relative_to(folder).as_posix()
        z.writestr(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    z.writestr(record.relative_to(folder).as_posix(), "\n".join(rows + [f"{record.relative_to(folder).as_posix()},,"]) + "\n")
PY
    rm -rf "$unpacked"
  done
  # libseccomp, which the sandbox's seccomp filter needs: Debian's package, unpacked by `install` where it is missing.
  (cd "$part" && apt-get download "libseccomp2:$deb_arch" >/dev/null 2>&1) ||
    echo "gpu_set.sh: apt-get download libseccomp2 failed (apt-get update first?): the GPU machine needs libseccomp2" >&2
  rm -rf "$wheels"
  mv "$part" "$wheels"
  # GPT-OSS's tokenizer, built offline from bpe-openai and openai-harmony (the CPU set has both).
  local built
  built=$(mktemp -d)
  "$python" gpt_oss_tokenizer.py --save "$built/gpt-oss-tokenizer" >/dev/null
  tar -C "$built" -czf "$tokenizer" gpt-oss-tokenizer
  rm -rf "$built"
  echo "gpu_set.sh: $(ls "$wheels" | wc -l) files in $wheels/ ($(du -sh "$wheels" | cut -f1)), $tokenizer ($(du -h "$tokenizer" | cut -f1))"
  echo "gpu_set.sh: copy the project with both to the GPU machine; there: bash bench/gpu_set.sh install"
}

install() {
  local python=${PYTHON:-python3}
  compgen -G "$wheels/*.whl" >/dev/null || die "no wheels in $wheels/: 'bash bench/gpu_set.sh pack' makes them on a machine with internet"
  # Into the interpreter itself, never a --target folder: the sandbox's server starts with an empty environment.
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir "$wheels"/*.whl
  if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
    if [ "$(id -u)" = 0 ] && compgen -G "$wheels/libseccomp2_*.deb" >/dev/null; then
      dpkg -x "$wheels"/libseccomp2_*.deb / && ldconfig
    else
      echo "gpu_set.sh: libseccomp2 is missing (the sandbox needs it): install it as root (apt-get install libseccomp2)" >&2
    fi
  fi
  check
}

case "$verb" in
  pack) pack "$@" ;;
  install) [ $# = 0 ] || die "install takes no arguments"; install ;;
  check) [ $# = 0 ] || die "check takes no arguments"; check ;;
  -h|--help) sed -n '2,14p' "$0" ;;
  *) die "usage: bash bench/gpu_set.sh pack [PACKAGE ...] | install | check (--help says more)" ;;
esac
