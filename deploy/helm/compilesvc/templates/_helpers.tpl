{{/* Names, labels and the pieces every compilesvc container shares. */}}

{{- define "compilesvc.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "compilesvc.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "compilesvc.labels" -}}
{{ include "compilesvc.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "compilesvc.imageRef" -}}
{{- $tag := .tag | default .appVersion -}}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository $tag }}{{ end -}}
{{- end -}}

{{- define "compilesvc.image" -}}
{{- include "compilesvc.imageRef" (merge (dict "appVersion" .Chart.AppVersion) .Values.image) -}}
{{- end -}}

{{/* The ledger URL of a role (its password is PGPASSWORD, from the component's Secret). */}}
{{- define "compilesvc.databaseUrl" -}}
{{- $db := .root.Values.database -}}
{{- printf "postgresql+psycopg://%s@%s:%d/%s?sslmode=%s" (index $db.users .role) $db.host (int $db.port) $db.name $db.sslmode -}}
{{- end -}}

{{- define "compilesvc.secretEnv" -}}
{{- $secret := (index .root.Values.secrets .component).existingSecret -}}
{{- range .required }}
- name: {{ . }}
  valueFrom: {secretKeyRef: {name: {{ $secret }}, key: {{ . }}}}
{{- end }}
{{- range .optional }}
- name: {{ . }}
  valueFrom: {secretKeyRef: {name: {{ $secret }}, key: {{ . }}, optional: true}}
{{- end }}
{{- if and .aws (eq .root.Values.aws.credentials "secret") }}
{{- range list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" }}
- name: {{ . }}
  valueFrom: {secretKeyRef: {name: {{ $secret }}, key: {{ . }}}}
{{- end }}
{{- end }}
{{- end -}}

{{- define "compilesvc.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
runAsNonRoot: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* Writable places of a compilesvc container on its read-only root: TMPDIR (the image's /var/tmp/compilesvc)
and COMPILESVC_DATA_DIR, plus /tmp. */}}
{{- define "compilesvc.scratchMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: data, mountPath: /var/lib/compilesvc}
{{- end -}}
{{- define "compilesvc.scratchVolumes" -}}
- name: tmp
  emptyDir: {sizeLimit: 1Gi}
- name: data
  emptyDir: {sizeLimit: 64Mi}
{{- end -}}

{{- define "compilesvc.signingKeyVolume" -}}
- name: signing-key
  secret:
    secretName: {{ .Values.secrets.signingKey.existingSecret }}
    defaultMode: 0400
    items: [{key: {{ .Values.secrets.signingKey.key }}, path: signing-key.pem}]
{{- end -}}

{{- define "compilesvc.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/* Grace of a worker pod: the drain window plus a margin, never below the window (the schema cannot compare
two values; this refuses the render instead). */}}
{{- define "compilesvc.workerGrace" -}}
{{- $drain := include "compilesvc.workerDrain" . | int -}}
{{- $grace := .pool.terminationGracePeriodSeconds | default (add $drain .root.Values.graceMarginSeconds) -}}
{{- if lt (int $grace) $drain -}}
{{- fail (printf "workers.pools[%s].terminationGracePeriodSeconds (%d) is shorter than drainWindowSeconds (%d): a draining worker would be killed mid-window" .pool.name (int $grace) $drain) -}}
{{- end -}}
{{- if gt $drain (int .root.Values.compileTimeoutSeconds) -}}
{{- fail (printf "drainWindowSeconds (%d) exceeds compileTimeoutSeconds (%d): no compile runs that long" $drain (int .root.Values.compileTimeoutSeconds)) -}}
{{- end -}}
{{- $grace -}}
{{- end -}}

{{/* A worker pool's drain window (COMPILESVC_DRAIN_SECONDS): its own, else the chart's. */}}
{{- define "compilesvc.workerDrain" -}}
{{- if hasKey .pool "drainWindowSeconds" }}{{ .pool.drainWindowSeconds }}{{ else }}{{ .root.Values.drainWindowSeconds }}{{ end -}}
{{- end -}}

{{/* The KEDA scaler's query: the pool's queued and running compiles (compilesvc/states.py), counted from the
partial index ix_bucket_compiles_active_queue (migration 0017) alone. */}}
{{- define "compilesvc.scalerQuery" -}}
{{- $quoted := list -}}
{{- range .queues }}{{ $quoted = append $quoted (printf "'%s'" .) }}{{ end -}}
SELECT count(*) FROM bucket_compiles WHERE state IN ('queued', 'running') AND queue IN ({{ join ", " $quoted }})
{{- end -}}

{{- define "compilesvc.scalerMetadata" -}}
{{- $db := .root.Values.database -}}
host: {{ $db.host | quote }}
port: {{ $db.port | toString | quote }}
dbName: {{ $db.name | quote }}
userName: {{ $db.users.scaler | quote }}
sslmode: {{ $db.sslmode | quote }}
query: {{ include "compilesvc.scalerQuery" .pool | quote }}
# Compiles per pod: replicas = ceil(queued + running / concurrency); the first queued compile wakes the pool.
targetQueryValue: {{ .pool.concurrency | toString | quote }}
activationTargetQueryValue: "0"
{{- end -}}
