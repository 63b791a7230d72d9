# The two commands of the README's quick start, each setting up .venv on first use (bash setup.sh: the GPU set
# where an NVIDIA GPU is visible, else the CPU set; again whenever setup.sh or a requirements file changes).
#   make demo    # the CPU demo: a tiny local model learns to prefer board-reading strategies, in minutes
#   make test    # ruff, then every test (slow ones included), then the Unsloth tier in a process of its own
VENV := .venv
STAMP := $(VENV)/.setup-done

.PHONY: demo test

$(STAMP): setup.sh requirements.txt requirements-cpu.txt
	bash setup.sh
	touch $@

demo: $(STAMP)
	$(VENV)/bin/python train_2048.py --config configs/cpu-demo.yaml

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -v
	TRAIN2048_UNSLOTH_TIER=1 $(VENV)/bin/python -m pytest -v tests/unsloth
