{{/* Names, labels and the pieces several templates share. */}}

{{/* The release's full name, at most 63 characters (a DNS label). */}}
{{- define "weightd.fullname" -}}
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

{{/* The labels that select the daemon's pods (the DaemonSet, the peer Service). */}}
{{- define "weightd.selectorLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Every object's labels. */}}
{{- define "weightd.labels" -}}
{{ include "weightd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The service account's name. */}}
{{- define "weightd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weightd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
A directory volume's source: a hostPath or a persistentVolumeClaim, exactly one of the two.
Called with (dict "v" ENTRY "what" "modelRoots[N]").
*/}}
{{- define "weightd.dirSource" -}}
{{- $v := .v -}}
{{- if and $v.hostPath $v.persistentVolumeClaim -}}
{{- fail (printf "%s: give hostPath or persistentVolumeClaim, not both" .what) -}}
{{- else if $v.persistentVolumeClaim -}}
persistentVolumeClaim:
  claimName: {{ $v.persistentVolumeClaim }}
  readOnly: {{ .readOnly }}
{{- else if $v.hostPath -}}
hostPath:
  path: {{ $v.hostPath }}
  type: {{ default "Directory" $v.hostPathType }}
{{- else -}}
{{- fail (printf "%s: give hostPath or persistentVolumeClaim" .what) -}}
{{- end -}}
{{- end -}}

{{/*
The daemon's configuration file: the values' config with the keys the chart owns set from the
other values (the socket in the shared directory, the model roots as mounted).
*/}}
{{- define "weightd.config" -}}
{{- range $k := list "socket" "socket_group" "model_roots" "metrics_address" -}}
{{- if hasKey $.Values.config $k -}}
{{- fail (printf "config.%s is set by the chart (socket, socketDir, modelRoots, cache, metrics): remove it from config" $k) -}}
{{- end -}}
{{- end -}}
{{- $roots := list -}}
{{- range $r := .Values.modelRoots -}}
{{- $roots = append $roots $r.mountPath -}}
{{- end -}}
{{- if .Values.cache.enabled -}}
{{- $roots = append $roots .Values.cache.mountPath -}}
{{- end -}}
{{- if not $roots -}}
{{- fail "modelRoots is empty and the cache is off: the daemon would serve any path it can read; name at least one model root" -}}
{{- end -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "socket" "/run/weightd/weightd.sock" -}}
{{- $_ := set $cfg "socket_group" "" -}}
{{- $_ := set $cfg "socket_mode" (toString .Values.socket.mode) -}}
{{- $_ := set $cfg "model_roots" $roots -}}
{{- toPrettyJson $cfg -}}
{{- end -}}
