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
{{- define "compilesvc.scratchSizes" -}}
{tmp: 1Gi, data: 64Mi}
{{- end -}}
{{- define "compilesvc.scratchVolumes" -}}
{{- $sizes := include "compilesvc.scratchSizes" . | fromYaml }}
- name: tmp
  emptyDir: {sizeLimit: {{ $sizes.tmp }}}
- name: data
  emptyDir: {sizeLimit: {{ $sizes.data }}}
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

{{/* A pod's metadata: the chart's labels (never overridden: the selectors use them) plus .values.podLabels and
.extraLabels; the chart's annotations (.annotations) plus .values.podAnnotations. */}}
{{- define "compilesvc.podMetadata" -}}
{{- $labels := include "compilesvc.labels" (dict "root" .root "component" .component) | fromYaml -}}
{{- range $k, $v := (.extraLabels | default dict) }}{{ $_ := set $labels $k $v }}{{ end -}}
{{- $component := .component -}}
{{- range $k, $v := (.values.podLabels | default dict) -}}
{{- if hasKey $labels $k -}}
{{- fail (printf "%s: podLabels may not set %s, the chart's own label (its selectors use it)" $component $k) -}}
{{- end -}}
{{- $_ := set $labels $k $v -}}
{{- end -}}
labels: {{- toYaml $labels | nindent 2 }}
{{- $annotations := merge (dict) (.annotations | default dict) (.values.podAnnotations | default dict) -}}
{{- with $annotations }}
annotations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Where a pod may run, beyond nodeSelector and tolerations: the component's priorityClassName,
runtimeClassName, affinity and topologySpreadConstraints (each omitted when empty). */}}
{{- define "compilesvc.podScheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- with .affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A quantity (a sizeLimit, an ephemeral-storage limit: "300Gi", "64Mi", 1073741824) in MiB, rounded up. */}}
{{- define "compilesvc.mib" -}}
{{- $q := toString . -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $suffix := trimPrefix $number $q -}}
{{- $bytes := dict "" 1.0 "k" 1000.0 "Ki" 1024.0 "M" 1000000.0 "Mi" 1048576.0 "G" 1000000000.0 "Gi" 1073741824.0 "T" 1000000000000.0 "Ti" 1099511627776.0 -}}
{{- if not (hasKey $bytes $suffix) }}{{ fail (printf "%s: not a storage quantity" $q) }}{{ end -}}
{{- divf (mulf (float64 $number) (index $bytes $suffix)) 1048576.0 | ceil | int64 -}}
{{- end -}}

{{/* A container's resources with its ephemeral-storage limit raised by the emptyDirs it writes (.volumes,
their sizeLimits). The kubelet sums the containers' ephemeral-storage limits into the pod's and evicts the pod,
without grace, once its containers' writable layers and logs plus its emptyDirs pass that sum
(kubernetes/kubernetes pkg/kubelet/eviction/eviction_manager.go, podEphemeralStorageLimitEviction); each
emptyDir is counted in exactly one container, so the pod's limit is the containers' own allowance plus every
emptyDir's sizeLimit. The request stays the container's own allowance: the scheduler need not reserve the
emptyDirs' worst case. */}}
{{- define "compilesvc.resources" -}}
{{- $limits := deepCopy (.resources.limits | default dict) -}}
{{- $requests := deepCopy (.resources.requests | default dict) -}}
{{- $base := index $limits "ephemeral-storage" -}}
{{- if not $base -}}
{{- fail (printf "%s: resources.limits.ephemeral-storage is unset; the kubelet's pod-level limit, the sum of the containers', must cover the pod's emptyDirs (%s), or it evicts the pod before they fill (docs/kubernetes.md, \"Ephemeral storage\")" .name (join ", " (keys .volumes | sortAlpha))) -}}
{{- end -}}
{{- $total := include "compilesvc.mib" $base | int64 -}}
{{- range $volume, $size := .volumes }}{{ $total = add $total (include "compilesvc.mib" $size | int64) }}{{ end -}}
{{- if not (hasKey $requests "ephemeral-storage") }}{{ $_ := set $requests "ephemeral-storage" $base }}{{ end -}}
{{- $_ := set $limits "ephemeral-storage" (printf "%dMi" $total) -}}
requests: {{- toYaml $requests | nindent 2 }}
limits: {{- toYaml $limits | nindent 2 }}
{{- end -}}

{{/* A worker pod's metadata. eks.amazonaws.com/skip-containers names the compile container: the EKS
pod-identity webhook then injects neither AWS variables nor its token volume there
(aws/amazon-eks-pod-identity-webhook pkg/handler/handler.go getContainersToSkip, a comma-separated list
applied to initContainers and containers alike), and the compile runner, which refuses both, starts. The
config checksum rolls the pool on a config change unless restartOnConfigChange is false. */}}
{{- define "compilesvc.workerPodMetadata" -}}
{{- $pool := .pool -}}
{{- $annotations := dict -}}
{{- if $pool.restartOnConfigChange }}{{ $annotations = include "compilesvc.configChecksum" .root | fromYaml }}{{ end -}}
{{- $values := deepCopy $pool -}}
{{- if eq $pool.sandbox "pod" -}}
{{- $key := "eks.amazonaws.com/skip-containers" -}}
{{- $names := list -}}
{{- with (index ($pool.podAnnotations | default dict) $key) }}{{ $names = splitList "," . }}{{ end -}}
{{- $_ := set $annotations $key (append $names "compile" | uniq | join ",") -}}
{{- $_ := set $values "podAnnotations" (omit ($pool.podAnnotations | default dict) $key) -}}
{{- end -}}
{{- include "compilesvc.podMetadata" (dict "root" .root "component" .component "values" $values "annotations" $annotations "extraLabels" (dict "compilesvc.dev/role" "worker")) -}}
{{- end -}}

{{/* A ScaledJob's activeDeadlineSeconds: its own (never below the compile timeout plus the drain and the
margin: the render refuses it), else that sum plus 10 minutes for the pod to start. */}}
{{- define "compilesvc.jobDeadline" -}}
{{- $drain := include "compilesvc.workerDrain" . | int -}}
{{- $floor := add .root.Values.compileTimeoutSeconds $drain .root.Values.graceMarginSeconds -}}
{{- $deadline := .pool.scaling.activeDeadlineSeconds | default (add $floor 600) | int -}}
{{- if lt $deadline (int $floor) -}}
{{- fail (printf "workers.pools[%s].scaling.activeDeadlineSeconds (%d) is less than compileTimeoutSeconds + drain + graceMarginSeconds (%d): the Job controller would kill a compile still within its time" .pool.name $deadline (int $floor)) -}}
{{- end -}}
{{- $deadline -}}
{{- end -}}

{{/* The egress proof's canaries (COMPILESVC_EGRESS_CANARIES, workers/isolation/egress.py): endpoints of the
service a compile's network must not reach. Rendered from this chart's own values: the API Service, the ledger
(database.host:port), the store (config.s3EndpointUrl's host:port, else S3's regional endpoint), then
workers.egress.canaries (the broker, whose URL is in a Secret the chart does not read; anything else). */}}
{{- define "compilesvc.egressCanaries" -}}
{{- $v := .Values -}}
{{- $list := list (printf "%s-api:%d" (include "compilesvc.fullname" .) (int $v.api.service.port)) (printf "%s:%d" $v.database.host (int $v.database.port)) -}}
{{- with $v.config.s3EndpointUrl -}}
{{- $u := urlParse . -}}
{{- $port := ternary "443" "80" (eq $u.scheme "https") -}}
{{- $list = append $list (ternary $u.host (printf "%s:%s" $u.host $port) (contains ":" $u.host)) -}}
{{- else -}}
{{- $list = append $list (printf "s3.%s.amazonaws.com:443" $v.config.s3Region) -}}
{{- end -}}
{{- range (($v.workers.egress | default dict).canaries | default list) }}{{ $list = append $list . }}{{ end -}}
{{- join "," (uniq $list) -}}
{{- end -}}

{{/* The env entries of the container whose network is the compile's (pod: the compile runner's; bwrap: the
worker's, which probes from inside its sandbox). */}}
{{- define "compilesvc.egressEnv" -}}
- {name: COMPILESVC_EGRESS_CANARIES, value: {{ include "compilesvc.egressCanaries" . | quote }}}
{{- if (.Values.workers.egress | default dict).acknowledged }}
- {name: COMPILESVC_EGRESS_ACKNOWLEDGED, value: "1"}
{{- end }}
{{- end -}}
