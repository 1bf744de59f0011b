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

# The operator's dependencies are the project's base set and its `[operator]` extra (kopf, the
# Kubernetes client, aiohttp, PyYAML, msgspec, prometheus-client, setproctitle, and pyzmq for
# the per-deployment CurveZMQ key pairs); the engine's stack (torch and the rest) is the
# `[engine]` extra, not installed here. The `atom` dispatcher imports a subcommand's module only
# when it runs. The last commands fail the build if torch sneaks in or the CLI cannot start.
RUN python3 -m pip install ".[operator]" \
 && python3 -c "import sys, atom_operator.handlers; assert 'torch' not in sys.modules" \
 && python3 -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch installed'" \
 && atom render --help >/dev/null \
 && atom operator run --help >/dev/null \
 && rm -rf /opt/atom/src

RUN groupadd --gid 1000 atom \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin atom
WORKDIR /tmp
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["atom"]
CMD ["operator", "run", "--standalone", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]
