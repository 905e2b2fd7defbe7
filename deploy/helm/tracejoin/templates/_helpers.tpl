{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "tracejoin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects. */}}
{{- define "tracejoin.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "tracejoin.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tracejoin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tracejoin
{{- end }}

{{/* The DaemonSet's selector, and what the metrics Service selects. Never change these on an
installed release: a DaemonSet's selector is immutable. */}}
{{- define "tracejoin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tracejoin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "tracejoin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tracejoin.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tracejoin.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* BPF and PERFMON, the opted-in optional ones, and extraCapabilities, without CAP_
prefixes, no repeats. Why each: docs/operations.md, "Privileges". */}}
{{- define "tracejoin.capabilities" -}}
{{- $caps := list "BPF" "PERFMON" }}
{{- if .Values.capabilities.sysPtrace }}
{{- $caps = append $caps "SYS_PTRACE" }}
{{- end }}
{{- if .Values.capabilities.dacReadSearch }}
{{- $caps = append $caps "DAC_READ_SEARCH" }}
{{- end }}
{{- range .Values.extraCapabilities }}
{{- $caps = append $caps (. | upper | trimPrefix "CAP_") }}
{{- end }}
{{- toYaml (uniq $caps) }}
{{- end }}

{{/* config.yaml: .Values.config with metrics_port taken from .Values.metricsPort. */}}
{{- define "tracejoin.config" -}}
{{- $cfg := deepCopy (default (dict) .Values.config) }}
{{- $_ := set $cfg "metrics_port" (int .Values.metricsPort) }}
{{- if not .Values.bpfCache.hostPath }}
{{- $_ := set $cfg "bpf_cache" "" }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The seccomp profile's directory under the kubelet's root dir, which the installer writes.
A profile directly in <root dir>/seccomp would give it the whole directory: refused. */}}
{{- define "tracejoin.seccompDir" -}}
{{- $dir := dir .Values.seccomp.localhostProfile }}
{{- if or (eq $dir ".") (hasPrefix "/" $dir) (contains ".." $dir) }}
{{- fail (printf "seccomp.localhostProfile (%s) must be a relative path in a directory of its own, like tracejoin/tracejoin.json" .Values.seccomp.localhostProfile) }}
{{- end }}
{{- printf "%s/seccomp/%s" (trimSuffix "/" .Values.seccomp.kubeletRootDir) $dir }}
{{- end }}

{{/* Whether the init container installs the profile. */}}
{{- define "tracejoin.installSeccomp" -}}
{{- if and (eq .Values.seccomp.type "Localhost") .Values.seccomp.install }}true{{ end }}
{{- end }}
