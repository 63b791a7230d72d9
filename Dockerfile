# train_2048 on NVIDIA's PyTorch container (CUDA 13): arm64 for a DGX Spark (GB10), amd64 for H100s.
#   docker buildx build --platform linux/arm64 -t train_2048 --load .           # on the DGX Spark itself
#   docker buildx build --platform linux/arm64,linux/amd64 -t <registry>/train_2048 --push .
# docs/GPU.md has the `docker run` command (its `mkdir -p ~/.cache/huggingface` first, and `--user`).
# NGC's torch build is kept: every pip call below runs under a constraint file that pins it, and
# Unsloth, unsloth_zoo and bitsandbytes go in with --no-deps (a plain `pip install unsloth` has replaced
# it with a CPU-only torch on arm64). So the image runs NGC 25.11's torch 2.10 (NVIDIA's CUDA 13.0 build, GB10
# included; NVIDIA's DGX Spark playbook for Unsloth uses this image), below requirements.txt's torch>=2.11: that floor
# is a venv's, where PyPI's first CUDA 13 torch for aarch64 is 2.11; Unsloth 2026.10.9 takes torch 2.4 to 2.14.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

# linux/arm64 or linux/amd64: set by buildx for each platform it builds
ARG TARGETARCH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# TRITON_PTXAS_PATH: NGC 25.11's Triton 3.5 has a ptxas that rejects GB10's sm_121a; the CUDA toolkit's knows it (and
# every older card). Triton 3.6 and later, a venv's with torch >= 2.11, ignore it and use their own Blackwell ptxas.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas

WORKDIR /workspace/train_2048

# Pin the image's torch stack, whatever its version strings (NGC's are pre-releases like 2.10.0a0+...nv25.11).
# pip applies `-c` files on top of NGC's own pins (/etc/pip/constraint.txt since 25.03), not instead of them.
RUN for dist in torch torchvision torchaudio triton pytorch-triton; do \
        python -c "import importlib.metadata as m; print('$dist==' + m.version('$dist'))" 2>/dev/null || true; \
    done > /etc/train_2048-torch-pins.txt \
    && cat /etc/train_2048-torch-pins.txt \
    && grep -q '^torch==' /etc/train_2048-torch-pins.txt

COPY requirements.txt ./

# 1. the GPU set but torch (NGC's) and the three --no-deps packages, versions from requirements.txt;
# 2. unsloth, unsloth_zoo, bitsandbytes and cut_cross_entropy without their dependencies (torch, triton);
# 3. the other dependencies of those, as their metadata lists them (`missing`: what pip check says they
#    lack, but the torch stack), within NGC's pins and the torch pins;
# 4. xformers: amd64 only, and only where a wheel matches NGC's torch (gpt-oss does not need it: eager or
#    flex attention); on arm64 no flash-attn: it has no sm_121 (GB10) build and breaks xformers' import;
# 5. fail the build, not the first training run: torch still NGC's CUDA build, nothing missing.
RUN missing() { \
        { pip check || true; } \
        | sed -nE 's/^(unsloth|unsloth[-_]zoo|bitsandbytes) [^ ]+ requires ([^,]+), which is not installed[.]$/\2/p' \
        | { grep -viE '^(torch|torchvision|torchaudio|triton|pytorch-triton|xformers)$' || true; }; \
    } \
    && pins=/etc/train_2048-torch-pins.txt \
    && grep -vE '^(torch|unsloth|unsloth_zoo|bitsandbytes)([<>=!~ ]|$)' requirements.txt > /tmp/gpu-set.txt \
    && grep -E '^(unsloth|unsloth_zoo|bitsandbytes)([<>=!~ ]|$)' requirements.txt > /tmp/no-deps.txt \
    && echo cut_cross_entropy >> /tmp/no-deps.txt \
    && pip install -c "$pins" -r /tmp/gpu-set.txt \
    && pip install -c "$pins" --no-deps -r /tmp/no-deps.txt \
    && missing | sort -u | tee /tmp/their-deps.txt \
    && if [ -s /tmp/their-deps.txt ]; then pip install -c "$pins" -r /tmp/their-deps.txt; fi \
    && if [ "$TARGETARCH" = amd64 ]; then \
        pip install -c "$pins" --only-binary=xformers xformers \
        || echo "train_2048: no xformers wheel for this torch; Unsloth runs without it"; \
    fi \
    && if [ "$TARGETARCH" = arm64 ]; then pip uninstall -y flash-attn; fi \
    && python -c "import torch; assert torch.version.cuda, 'torch lost its CUDA build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    && grep -qxF "torch==$(python -c 'import importlib.metadata as m; print(m.version("torch"))')" "$pins" \
    && if missing | grep .; then echo "train_2048: the packages above are still missing"; exit 1; fi \
    && rm /tmp/gpu-set.txt /tmp/no-deps.txt /tmp/their-deps.txt

COPY . .

# Any user may run the image (docker run --user "$(id -u):$(id -g)"): caches and the project folder,
# where outputs/ and Unsloth's compiled cache go when no host folder is mounted, are writable by all.
RUN mkdir -p /cache/huggingface /cache/triton \
    && chmod 1777 /cache /cache/huggingface /cache/triton /workspace/train_2048

VOLUME ["/cache/huggingface"]
# TensorBoard: docker run ... -p 6006:6006 --entrypoint tensorboard train_2048 --logdir outputs --bind_all
EXPOSE 6006

# NGC's own entrypoint first: it turns on CUDA forward compatibility (datacenter cards such as the H100) where the host's
# driver predates the image's CUDA 13.0 (below R580), then runs ours. A base image without it fails the build here.
RUN test -x /opt/nvidia/nvidia_entrypoint.sh
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "python", "train_2048.py"]
