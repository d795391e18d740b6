{{/*
Base name of every object. Cluster-scoped objects (ClusterRole, webhook configurations) carry it
too, so one release per cluster. Defaults to "sluice", the names deploy/ uses.
*/}}
{{- define "sluice.fullname" -}}
{{- default "sluice" .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.labels" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "sluice.sidecarImage" -}}
{{- $repo := default .Values.image.repository .Values.sidecar.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.sidecar.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* Service of the webhooks; its DNS names are the serving certificate's names. */}}
{{- define "sluice.webhookService" -}}
{{- printf "%s-webhook" (include "sluice.fullname" .) -}}
{{- end -}}

{{- define "sluice.webhookSecret" -}}
{{- default (printf "%s-webhook-tls" (include "sluice.fullname" .)) .Values.webhooks.secretName -}}
{{- end -}}

{{- define "sluice.webhookHosts" -}}
{{- $svc := include "sluice.webhookService" . -}}
{{- $ns := .Release.Namespace -}}
{{- printf "%s.%s.svc,%s.%s,%s.%s.svc.%s" $svc $ns $svc $ns $svc $ns .Values.clusterDomain -}}
{{- end -}}

{{/* The check API Service's DNS names: in the serving certificate when the check API is on TLS. */}}
{{- define "sluice.checkHosts" -}}
{{- $svc := include "sluice.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- printf "%s.%s.svc,%s.%s,%s.%s.svc.%s" $svc $ns $svc $ns $svc $ns .Values.clusterDomain -}}
{{- end -}}

{{/* Every name the operator's one serving certificate covers (webhooks, and the check API
Service when its HTTP or gRPC port serves TLS). */}}
{{- define "sluice.certificateHosts" -}}
{{- $hosts := list -}}
{{- if .Values.webhooks.enabled -}}{{- $hosts = concat $hosts (splitList "," (include "sluice.webhookHosts" .)) -}}{{- end -}}
{{- if or .Values.tls.enabled (and .Values.grpc.enabled .Values.grpc.tls) -}}{{- $hosts = concat $hosts (splitList "," (include "sluice.checkHosts" .)) -}}{{- end -}}
{{- join "," $hosts -}}
{{- end -}}

{{- define "sluice.leaseName" -}}
{{- default (printf "%s-operator" (include "sluice.fullname" .)) .Values.operator.leaseName -}}
{{- end -}}

{{/* What injected sidecars ask: this release's check API Service. */}}
{{- define "sluice.sidecarEndpoint" -}}
{{- $scheme := ternary "https" "http" .Values.tls.enabled -}}
{{- default (printf "%s://%s.%s.svc:%d" $scheme (include "sluice.fullname" .) .Release.Namespace (int .Values.service.port)) .Values.sidecar.endpoint -}}
{{- end -}}
