{{/* Names and labels. */}}
{{- define "pagekeeper.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagekeeper.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagekeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagekeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagekeeper.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagekeeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pagekeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagekeeper.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pagekeeper.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion (ternary "cuda" "cpu" .Values.gpu.enabled)) -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The drain budget: the preStop's delay and drain, then the supervisor's exit; the kubelet SIGKILLs after it. */}}
{{- define "pagekeeper.terminationGracePeriod" -}}
{{- $delay := int .Values.lifecycle.endpointDelaySeconds -}}
{{- $drain := int .Values.supervisor.drainTimeoutSeconds -}}
{{- $set := int .Values.lifecycle.terminationGracePeriodSeconds -}}
{{- if eq $set 0 -}}
{{- add $delay $drain 30 -}}
{{- else if le $set (add $delay $drain) -}}
{{- fail (printf "lifecycle.terminationGracePeriodSeconds %d must exceed endpointDelaySeconds + supervisor.drainTimeoutSeconds (%d): the kubelet would kill requests still draining" $set (add $delay $drain)) -}}
{{- else -}}
{{- $set -}}
{{- end -}}
{{- end -}}

{{/* startupProbe: enough periods to cover the cold start, plus one. */}}
{{- define "pagekeeper.startupFailureThreshold" -}}
{{- $period := int .Values.probes.periodSeconds -}}
{{- add (div (add (int .Values.probes.coldStartSeconds) (sub $period 1)) $period) 1 -}}
{{- end -}}

{{/* One TOML value (the config file is TOML; Helm reads every YAML number as a float, TOML wants 8192, not 8192.0). */}}
{{- define "pagekeeper.tomlValue" -}}
{{- $v := . -}}
{{- if kindIs "bool" $v -}}
{{- $v -}}
{{- else if or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- if eq (float64 $v) (floor $v) -}}{{ int64 $v }}{{- else -}}{{ $v }}{{- end -}}
{{- else if kindIs "string" $v -}}
{{- toJson $v -}}
{{- else if kindIs "slice" $v -}}
[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "pagekeeper.tomlValue" $e }}{{ end }}]
{{- else -}}
{{- fail (printf "config value %v: only strings, numbers, booleans and lists of them" $v) -}}
{{- end -}}
{{- end -}}

{{/* One TOML section: the chart's keys, then the user's extra keys (which may not override the chart's). */}}
{{- define "pagekeeper.tomlSection" -}}
{{- $fixed := index . 0 -}}
{{- $extra := index . 1 -}}
{{- $section := index . 2 -}}
{{- range $k, $v := $fixed }}
{{ $k }} = {{ include "pagekeeper.tomlValue" $v }}
{{- end }}
{{- range $k, $v := $extra }}
{{- if hasKey $fixed $k }}
{{- fail (printf "%s.extra.%s: the chart sets this key itself (see values.yaml)" $section $k) }}
{{- end }}
{{- if not (regexMatch "^[a-z][a-z0-9_]*$" $k) }}
{{- fail (printf "%s.extra.%s: not a config key (lower case, underscores)" $section $k) }}
{{- end }}
{{ $k }} = {{ include "pagekeeper.tomlValue" $v }}
{{- end }}
{{- end -}}

{{- define "pagekeeper.configPath" -}}/etc/pagekeeper/pagekeeper.toml{{- end -}}
{{/* The runtime dir is created 0700 by the supervisor inside the emptyDir mounted at /run/pagekeeper (an emptyDir
     itself is root's and world-writable, which opsctl refuses as a runtime dir). */}}
{{- define "pagekeeper.runtimeDir" -}}/run/pagekeeper/runtime{{- end -}}
