{{/* Names and labels shared by every object of the chart. */}}

{{- define "shardplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "shardplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shardplane
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* selectorLabels COMPONENT: the labels a component's pods are chosen by. */}}
{{- define "shardplane.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* podLabels COMPONENT: a pod's labels, its selector labels among them. */}}
{{- define "shardplane.podLabels" -}}
{{ include "shardplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: shardplane
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "shardplane.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{- define "shardplane.operatorName" -}}{{ include "shardplane.fullname" . }}-operator{{- end -}}
{{- define "shardplane.gatewayName" -}}{{ include "shardplane.fullname" . }}-gateway{{- end -}}
{{- define "shardplane.agentName" -}}{{ include "shardplane.fullname" . }}-agent{{- end -}}

{{- define "shardplane.tokenSecretName" -}}
{{- .Values.dataPlaneToken.existingSecret | default (printf "%s-data-plane-token" (include "shardplane.fullname" .)) -}}
{{- end -}}

{{- define "shardplane.apiKeysSecretName" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (printf "%s-api-keys" (include "shardplane.fullname" .)) -}}
{{- end -}}

{{/* The hardened security context every container runs with. */}}
{{- define "shardplane.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* scheduling DICT: nodeSelector, tolerations, affinity, priorityClassName. */}}
{{- define "shardplane.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/*
requireCluster DICT(root, what, set): fails unless lookup reaches the cluster.
Offline (helm template, Argo CD, a client dry run) lookup answers nothing, so
a generated value would change on every render.
*/}}
{{- define "shardplane.requireCluster" -}}
{{- if not (lookup "v1" "Namespace" "" "").items }}
{{- fail (printf "cannot generate %s without access to the cluster (helm template and Argo CD render offline, and a value generated there changes on every render): set %s; see docs/helm.md, \"Secrets under GitOps\"" .what .set) }}
{{- end }}
{{- end -}}

{{/* spread DICT(root, component, values): topologySpreadConstraints over the
component's own pods, when values.topologySpread.enabled. */}}
{{- define "shardplane.spread" -}}
{{- with .values.topologySpread }}
{{- if .enabled }}
topologySpreadConstraints:
  - maxSkew: {{ .maxSkew }}
    topologyKey: {{ .topologyKey }}
    whenUnsatisfiable: {{ .whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "shardplane.selectorLabels" (dict "root" $.root "component" $.component) | nindent 8 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* pdb DICT(root, component, values): a PodDisruptionBudget for a component
with more than one replica, when values.podDisruptionBudget.enabled. */}}
{{- define "shardplane.pdb" -}}
{{- $pdb := .values.podDisruptionBudget }}
{{- if and $pdb.enabled (gt (int .values.replicas) 1) }}
---
apiVersion: {{ if .root.Capabilities.APIVersions.Has "policy/v1" }}policy/v1{{ else }}policy/v1beta1{{ end }}
kind: PodDisruptionBudget
metadata:
  name: {{ include "shardplane.fullname" .root }}-{{ .component }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "shardplane.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  maxUnavailable: {{ $pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "shardplane.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
Reading the Secrets that Models name for their own Hugging Face token
(tokenSecretRef): a ClusterRole rule when modelTokenSecrets.allNamespaces,
else nothing here (see shardplane.modelTokenRoles).
*/}}
{{- define "shardplane.modelTokenRule" -}}
{{- if .Values.modelTokenSecrets.allNamespaces }}
  # Hugging Face tokens that Models name (tokenSecretRef), read by name;
  # only Secrets labelled shardplane.dev/hugging-face-token=true are used.
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["get"]
{{- end }}
{{- end }}

{{/*
The same, per namespace of modelTokenSecrets.namespaces: a Role and a
RoleBinding for the ServiceAccount `name`. Call with (list $ $name).
*/}}
{{- define "shardplane.modelTokenRoles" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- if not $root.Values.modelTokenSecrets.allNamespaces }}
{{- range $ns := $root.Values.modelTokenSecrets.namespaces }}
---
# Hugging Face tokens that Models in {{ $ns }} name, read by name.
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ $name }}-model-tokens
  namespace: {{ $ns }}
  labels:
    {{- include "shardplane.labels" $root | nindent 4 }}
rules:
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["get"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ $name }}-model-tokens
  namespace: {{ $ns }}
  labels:
    {{- include "shardplane.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ $name }}-model-tokens
subjects:
  - kind: ServiceAccount
    name: {{ $name }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}
