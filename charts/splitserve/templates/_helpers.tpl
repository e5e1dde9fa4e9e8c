{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "splitserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "splitserve.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.baseLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.baseLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.operatorLabels" -}}
{{ include "splitserve.baseLabels" . }}
{{ include "splitserve.operatorSelector" . }}
{{- end -}}

{{/* The operator's pods; the NetworkPolicy the operator renders for an in-cluster
Redis admits pods with app.kubernetes.io/name=splitserve-operator, keep them equal. */}}
{{- define "splitserve.operatorSelector" -}}
app.kubernetes.io/name: splitserve-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "splitserve.runbook" -}}
{{- printf "%s#%s" .root.Values.prometheusRule.runbookBaseUrl (lower .alert) -}}
{{- end -}}
