{{/* Chart name, overridable with nameOverride. */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name prefix of every resource: fullnameOverride, else the release name when it already
contains the chart name, else "<release>-<chart name>"; cut to the 63 characters of a DNS label.
*/}}
{{- define "ferry.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator's resources are named "<fullname>-operator". */}}
{{- define "ferry.operatorName" -}}
{{- printf "%s-operator" (include "ferry.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The metrics Service: "<fullname>-operator-metrics". */}}
{{- define "ferry.metricsServiceName" -}}
{{- printf "%s-metrics" (include "ferry.operatorName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ferry.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every resource. */}}
{{- define "ferry.labels" -}}
helm.sh/chart: {{ include "ferry.chart" . }}
{{ include "ferry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
{{- end -}}

{{/* Labels selecting the operator pods (immutable in the Deployment: keep them stable). */}}
{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "ferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferry.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
An image reference from image values (registry, repository, tag, digest) and the tag to use
when none is set: "[<registry>/]<repository>@<digest>", else "[<registry>/]<repository>:<tag>".
Called with a list: (image values, default tag).
*/}}
{{- define "ferry.imageReference" -}}
{{- $defaultTag := index . 1 -}}
{{- with index . 0 -}}
{{- if .registry -}}{{ printf "%s/%s" .registry .repository }}{{- else -}}{{ .repository }}{{- end -}}
{{- if .digest -}}{{ printf "@%s" .digest }}{{- else -}}{{ printf ":%s" (.tag | default $defaultTag) }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator image reference. */}}
{{- define "ferry.image" -}}
{{- include "ferry.imageReference" (list .Values.image .Chart.AppVersion) -}}
{{- end -}}

{{/* The forwarder image reference, passed to the operator (`--forwarder-image`). */}}
{{- define "ferry.forwarderImage" -}}
{{- include "ferry.imageReference" (list .Values.forwarder.image .Chart.AppVersion) -}}
{{- end -}}

{{/* Labels of the forwarder pods the operator renders (not managed by this chart). */}}
{{- define "ferry.forwarderSelectorLabels" -}}
app.kubernetes.io/name: ferry-forwarder
{{- end -}}

{{/* Labels of the CRDs: the chart's, with the API's version (appVersion), not the image tag. */}}
{{- define "ferry.crdLabels" -}}
helm.sh/chart: {{ include "ferry.chart" . }}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
app.kubernetes.io/component: crds
{{- end -}}

{{/* Labels of the uninstall hook's objects: not the operator's selector labels. */}}
{{- define "ferry.uninstallLabels" -}}
helm.sh/chart: {{ include "ferry.chart" . }}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
app.kubernetes.io/component: uninstall-hook
{{- end -}}
