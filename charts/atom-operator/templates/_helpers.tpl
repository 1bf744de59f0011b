{{- define "atom-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "atom-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "atom-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "atom-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "atom-operator.labels" -}}
{{ include "atom-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "atom-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "atom-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespaces of a namespaced install, as a JSON list: the release namespace alone with
`namespaced`, else watchNamespaces (empty: cluster-wide). */}}
{{- define "atom-operator.watchedNamespaces" -}}
{{- if .Values.namespaced }}
{{- list .Release.Namespace | toJson }}
{{- else }}
{{- .Values.watchNamespaces | toJson }}
{{- end }}
{{- end }}

{{/* What the operator reconciles, in every namespace or in the watched ones. */}}
{{- define "atom-operator.rules" -}}
- apiGroups: ["serving.atom.dev"]
  resources: ["atomdeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["serving.atom.dev"]
  resources: ["atomdeployments/status"]
  verbs: ["get", "patch", "update"]
# ownerReferences with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement
# is enabled.
- apiGroups: ["serving.atom.dev"]
  resources: ["atomdeployments/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# provider keda: one ScaledObject per autoscaled role (harmless where KEDA is not installed).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# spec.inferencePool: a Gateway API Inference Extension InferencePool.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# provider builtin: the operator lists a role's ready pods to scrape their /metrics.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Disaggregated mode: each router gets a ServiceAccount, Role and RoleBinding (its EndpointSlice
# watch). Kubernetes lets the operator create a Role, or bind one, only if the operator itself
# holds every permission in it (no escalation): hence the endpointslices rule below, which the
# operator does not use otherwise. Keep it in step with ROUTER_RULES in render/router.py.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# The per-deployment keys Secret (<name>-atom-keys) and a Hugging Face model-cache claim are
# created once and never read or patched: `create` only. The operator cannot read any Secret.
- apiGroups: [""]
  resources: ["secrets", "persistentvolumeclaims"]
  verbs: ["create"]
{{- end }}
