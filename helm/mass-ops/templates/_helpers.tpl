{{/* Chart name, overridable. */}}
{{- define "mass-ops.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects. Kept to 45 characters so that "<fullname>-<suffix>" names stay within the
63-character limit of Kubernetes names.
*/}}
{{- define "mass-ops.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object; the component label is added per object. */}}
{{- define "mass-ops.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "mass-ops.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mass-ops
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* "repository:tag" of one entry of .Values.images; an empty tag means the chart's appVersion. */}}
{{- define "mass-ops.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "mass-ops.launcherServiceAccount" -}}
{{- default (printf "%s-launcher" (include "mass-ops.fullname" .)) .Values.serviceAccounts.launcher.name }}
{{- end }}

{{- define "mass-ops.workloadServiceAccount" -}}
{{- default (printf "%s-workload" (include "mass-ops.fullname" .)) .Values.serviceAccounts.workload.name }}
{{- end }}

{{- define "mass-ops.modelCacheClaim" -}}
{{- default (printf "%s-model-cache" (include "mass-ops.fullname" .)) .Values.modelCache.existingClaim }}
{{- end }}

{{- define "mass-ops.trainingPriorityClass" -}}
{{- default (printf "%s-training" (include "mass-ops.fullname" .)) .Values.trainingPriority.name }}
{{- end }}

{{/*
Labels the operators put on the pods they create. The episode NetworkPolicy selects on mass-ops/role and lets
episodes reach pods with the inference component label, so these are a contract, not decoration.
*/}}
{{- define "mass-ops.workloadLabels" -}}
episode:
  app.kubernetes.io/component: episode
  mass-ops/role: episode
inference:
  app.kubernetes.io/component: inference
training:
  app.kubernetes.io/component: training
{{- end }}
