# The README's commands, each setting up .venv on first use (bash setup.sh: the GPU set
# where an NVIDIA GPU is visible, else the CPU set; again whenever setup.sh or a requirements file changes).
#   make demo    # the CPU demo: a tiny local model learns to prefer board-reading strategies, in minutes
#                # (again: make demo ARGS="--overwrite_output_dir true", or ARGS="--resume auto")
#   make test    # ruff, then every test (slow ones included), then the Unsloth tier in a process of its own
#   make gpu-check  # on a GPU machine: whether the default path works and how fast (docs/GPU_CHECK.md), planned at ~6 min
#   make aarch64-check  # the sandbox's checks on an aarch64 kernel, a DGX Spark's CPU: in a VM here, natively there
VENV := .venv
STAMP := $(VENV)/.setup-done

.PHONY: demo test gpu-check aarch64-check

$(STAMP): setup.sh requirements.txt requirements-cpu.txt
	bash setup.sh
	touch $@

demo: $(STAMP)
	$(VENV)/bin/python train_2048.py --config configs/cpu-demo.yaml $(ARGS)

# The GPU set (setup.sh on a GPU machine) has no test tools: the CPU set's are added on first use. Order-only, so
# a set-up newer than them does not install them again.
$(VENV)/bin/pytest: | $(STAMP)
	$(VENV)/bin/python -m pip install --quiet $$(grep -E '^(pytest|hypothesis|ruff)[<>=]' requirements-cpu.txt)

test: $(STAMP) $(VENV)/bin/pytest
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -v
	TRAIN2048_UNSLOTH_TIER=1 $(VENV)/bin/python -m pytest -v tests/unsloth

# A DGX Spark's exports (setup.sh writes them there) apply to the check's runs too.
gpu-check: $(STAMP)
	if [ -f $(VENV)/gb10.env ]; then . ./$(VENV)/gb10.env; fi; $(VENV)/bin/python bench/gpu_matrix.py 1

# An arm64 VM built from Debian's packages on any other machine (apt-get install -y qemu-system-arm mmdebstrap cpio;
# the root is kept in .aarch64/), natively on an aarch64 one (bench/aarch64_check.py).
aarch64-check: $(STAMP) $(VENV)/bin/pytest
	$(VENV)/bin/python bench/aarch64_check.py
