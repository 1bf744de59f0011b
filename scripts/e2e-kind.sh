#!/usr/bin/env bash
# End-to-end check of the operator on a throwaway kind cluster, CPU only:
#   build the runtime (CPU) and operator images, create a kind cluster, load the images,
#   install the Helm chart, apply examples/cpu-smollm2.yaml, wait for the AtomDeployment to be
#   Ready, then query /v1/models through the Service it created.
#
# Needs docker, kind, kubectl, helm and curl on PATH. Usage:
#   scripts/e2e-kind.sh                 # build, deploy, check, delete the cluster
#   KEEP_CLUSTER=1 scripts/e2e-kind.sh  # leave the cluster up to poke at it
#   SKIP_BUILD=1 scripts/e2e-kind.sh    # reuse images already built with the tags below
set -euo pipefail

CLUSTER="${CLUSTER:-atom-e2e}"
OPERATOR_NAMESPACE="${OPERATOR_NAMESPACE:-atom-system}"
VERSION="${VERSION:-0.1.0}"
RUNTIME_IMAGE="${RUNTIME_IMAGE:-ghcr.io/atom-serving/atom-runtime:${VERSION}-cpu}"
OPERATOR_IMAGE_REPO="${OPERATOR_IMAGE_REPO:-ghcr.io/atom-serving/atom-operator}"
OPERATOR_IMAGE="${OPERATOR_IMAGE_REPO}:${VERSION}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu}"
READY_TIMEOUT="${READY_TIMEOUT:-15m}"
LOCAL_PORT="${LOCAL_PORT:-18000}"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
example="${repo}/examples/cpu-smollm2.yaml"
port_forward_pid=""

log() { printf '\n==> %s\n' "$*"; }

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "e2e-kind: $1 is not on PATH" >&2; exit 2; }
}

cleanup() {
  local status=$?
  if [ -n "${port_forward_pid}" ]; then
    kill "${port_forward_pid}" 2>/dev/null || true
  fi
  if [ "${status}" -ne 0 ]; then
    log "failed; operator logs and AtomDeployment status follow"
    kubectl -n "${OPERATOR_NAMESPACE}" logs deployment/atom-operator --tail=100 || true
    kubectl get atomd smollm2 -o yaml || true
    kubectl get pods -o wide || true
  fi
  if [ "${KEEP_CLUSTER:-0}" != "1" ]; then
    kind delete cluster --name "${CLUSTER}" >/dev/null 2>&1 || true
  fi
  exit "${status}"
}

for tool in docker kind kubectl helm curl; do need "${tool}"; done

if [ "${SKIP_BUILD:-0}" != "1" ]; then
  log "building ${RUNTIME_IMAGE} (CPU torch) and ${OPERATOR_IMAGE}"
  docker build -f "${repo}/docker/runtime.Dockerfile" \
    --build-arg BASE_IMAGE=python:3.12-slim \
    --build-arg TORCH_SPEC="${TORCH_SPEC}" \
    -t "${RUNTIME_IMAGE}" "${repo}"
  docker build -f "${repo}/docker/operator.Dockerfile" -t "${OPERATOR_IMAGE}" "${repo}"
fi

trap cleanup EXIT

if ! kind get clusters | grep -qx "${CLUSTER}"; then
  log "creating kind cluster ${CLUSTER}"
  kind create cluster --name "${CLUSTER}" --wait 120s
fi
kubectl config use-context "kind-${CLUSTER}" >/dev/null

log "loading images into the cluster"
kind load docker-image --name "${CLUSTER}" "${RUNTIME_IMAGE}" "${OPERATOR_IMAGE}"

log "installing the chart (CRD, RBAC, operator)"
helm upgrade --install atom-operator "${repo}/charts/atom-operator" \
  --namespace "${OPERATOR_NAMESPACE}" --create-namespace \
  --set image.repository="${OPERATOR_IMAGE_REPO}" \
  --set image.tag="${VERSION}" \
  --set image.pullPolicy=IfNotPresent \
  --wait --timeout 5m

log "applying ${example#"${repo}"/}"
# The example names the default CPU image; point it at the one loaded above.
sed "s|image: ghcr.io/atom-serving/atom-runtime:.*|image: ${RUNTIME_IMAGE}|" "${example}" \
  | kubectl apply -f -

log "waiting up to ${READY_TIMEOUT} for the AtomDeployment to be Ready"
kubectl wait atomd/smollm2 --for=condition=Ready --timeout="${READY_TIMEOUT}"
kubectl get atomd smollm2

log "querying /v1/models through svc/smollm2"
kubectl port-forward svc/smollm2 "${LOCAL_PORT}:8000" >/dev/null 2>&1 &
port_forward_pid=$!
models=""
for _ in $(seq 1 30); do
  if models="$(curl -fsS "http://127.0.0.1:${LOCAL_PORT}/v1/models")"; then
    break
  fi
  sleep 1
done
echo "${models}"
case "${models}" in
  *'"SmolLM2-135M-Instruct"'*) log "e2e passed: the operator served SmolLM2 on kind" ;;
  *) echo "e2e-kind: /v1/models did not list SmolLM2-135M-Instruct" >&2; exit 1 ;;
esac
