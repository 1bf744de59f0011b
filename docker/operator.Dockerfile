# syntax=docker/dockerfile:1
# The ATOM operator image (`atom operator run`): small, no torch, no GPU stack.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/atom-serving/atom-operator:0.1.0 .
ARG BASE_IMAGE=python:3.12-slim
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

# pyproject.toml lists one dependency set for the whole distribution, torch and the engine's
# stack included (gigabytes). The operator imports none of it: the `atom` dispatcher imports a
# subcommand's module only when that subcommand runs, and atom_operator needs kopf, the
# Kubernetes client and PyYAML. So install the project with --no-deps and then exactly those
# (the same lower bounds as pyproject.toml); the `atom` console script still comes with it.
# msgspec too: the console script imports the atom_runtime package, whose __init__ exports
# SamplingParams (a msgspec Struct). The last two commands fail the build if torch sneaks in or
# the CLI cannot start.
RUN python3 -m pip install --no-deps . \
 && python3 -m pip install "kopf>=1.37" "kubernetes>=29" "pyyaml>=6" "msgspec>=0.18" \
    "prometheus-client>=0.20" \
 && python3 -c "import sys, atom_operator.handlers; assert 'torch' not in sys.modules" \
 && atom render --help >/dev/null \
 && rm -rf /opt/atom/src

RUN groupadd --gid 1000 atom \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin atom
WORKDIR /tmp
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["atom"]
CMD ["operator", "run", "--standalone", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]
