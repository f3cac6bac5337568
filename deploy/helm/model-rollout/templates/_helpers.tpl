{{- /* The labels every object of the chart carries: which release it belongs to. */ -}}
{{- define "model-rollout.labels" -}}
app.kubernetes.io/name: model-rollout-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
{{- end -}}

{{- /* The operator pods' selector: this release's operator only. */ -}}
{{- define "model-rollout.selector" -}}
app.kubernetes.io/name: model-rollout-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* The operator image: image.tag, or the chart's appVersion (the release's own build). */ -}}
{{- define "model-rollout.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}
