{{/* A worker pool's pod spec (Deployment and ScaledJob alike). */}}
{{- define "compilesvc.workerPod" -}}
{{- $root := .root -}}{{- $pool := .pool -}}
{{- $neuron := ne $pool.target "cpu" -}}
{{- $pod := eq $pool.sandbox "pod" -}}
{{- if and $pod (ne (int $pool.concurrency) 1) -}}
{{- fail (printf "workers.pools[%s]: concurrency %d with sandbox pod; a pod has one compile runner, so one compile at a time (docs/deploy.md, \"Compile isolation\"): scale with replicas" $pool.name (int $pool.concurrency)) -}}
{{- end -}}
serviceAccountName: {{ include "compilesvc.fullname" $root }}-worker
automountServiceAccountToken: false
enableServiceLinks: false
{{- if $pod }}
shareProcessNamespace: false  # the compile cannot see or signal the worker
{{- else }}
hostUsers: false  # bubblewrap's user namespaces inside a user-namespaced pod: its root is no host root
{{- end }}
restartPolicy: {{ .restartPolicy }}
terminationGracePeriodSeconds: {{ include "compilesvc.workerGrace" (dict "root" $root "pool" $pool) }}
securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if or $pool.tolerations (gt (int $pool.neuronDevices) 0) }}
tolerations:
  {{- with $pool.tolerations }}{{ toYaml . | nindent 2 }}{{ end }}
  {{- if gt (int $pool.neuronDevices) 0 }}
  - {key: aws.amazon.com/neuron, operator: Exists, effect: NoSchedule}
  {{- end }}
{{- end }}
{{- include "compilesvc.podScheduling" $pool }}
{{- if $pod }}
initContainers:
  # deploy/kubernetes/compile-worker-pod.yaml: no env, no secret, no token; PID 1 of its container. A native
  # sidecar (an init container that keeps running, Kubernetes 1.29+): the kubelet starts it before the worker
  # and stops it only after the worker has exited, so a draining worker's compile is not killed under it, and
  # a Job's pod (scaledJob) completes when its worker does.
  - name: compile
    restartPolicy: Always
    image: {{ include "compilesvc.imageRef" (merge (dict "appVersion" $root.Chart.AppVersion) ($pool.image | default dict) $root.Values.image) }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command: ["python", "-m", "workers.isolation.compile_runner", "--spool", "/spool"]
    # The runner's own settings only (it refuses service settings): the egress proof's canaries, which it dials
    # from the compile's network at start and before every compile (workers/isolation/egress.py).
    env:
      {{- include "compilesvc.egressEnv" $root | nindent 6 }}
    livenessProbe:
      exec:
        command: ["python", "-c", "import os, sys, time; sys.exit(time.time() - os.stat('/spool/runner/heartbeat').st_mtime > 30)"]
      initialDelaySeconds: 10
      periodSeconds: 10
    readinessProbe:
      exec:
        command: ["python", "-c", "import os, sys, time; sys.exit(time.time() - os.stat('/spool/runner/heartbeat').st_mtime > 30)"]
      initialDelaySeconds: 10
      periodSeconds: 10
    volumeMounts:
      - {name: spool, mountPath: /spool/attempts, subPath: attempts}
      - {name: spool, mountPath: /spool/runner, subPath: runner}
      - {name: spool, mountPath: /spool/models, subPath: models, readOnly: true}
    {{- $resources := include "compilesvc.resources" (dict "name" (printf "workers.pools[%s].compileResources" $pool.name) "resources" $pool.compileResources "volumes" (dict "spool" $pool.workSizeLimit)) | fromYaml }}
    {{- if gt (int $pool.neuronDevices) 0 }}{{ $_ := set $resources.limits "aws.amazon.com/neuron" $pool.neuronDevices }}{{ end }}
    resources: {{- toYaml $resources | nindent 6 }}
    securityContext: {{- include "compilesvc.containerSecurityContext" $root | nindent 6 }}
{{- end }}
containers:
  - name: worker
    image: {{ include "compilesvc.imageRef" (merge (dict "appVersion" $root.Chart.AppVersion) ($pool.image | default dict) $root.Values.image) }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args: ["worker", "--concurrency", {{ $pool.concurrency | quote }}, "--queues", {{ join "," $pool.queues | quote }}, "--name", "{{ $pool.name }}@$(POD_NAME)"{{ if eq $pool.scaling.mode "scaledJob" }}, "--max-compiles", "1"{{ end }}]
    # Alive = consuming (workers/liveness.py): the worker's canary check, read from its liveness file. A worker
    # that stops consuming exits 75 by itself once its compiles end, and stays alive to this probe meanwhile;
    # the probe restarts one whose checking stopped (frozen) after 3 x 30 s.
    livenessProbe:
      exec:
        command: ["python", "-m", "compilesvc.liveness", "worker"]
      initialDelaySeconds: 60
      periodSeconds: 30
      timeoutSeconds: 10
      failureThreshold: 3
    envFrom: [{configMapRef: {name: {{ include "compilesvc.fullname" $root }}-config}}]
    env:
      - name: POD_NAME
        valueFrom: {fieldRef: {fieldPath: metadata.name}}
      - {name: COMPILESVC_DATABASE_URL, value: {{ include "compilesvc.databaseUrl" (dict "root" $root "role" "worker") | quote }}}
      - {name: COMPILESVC_SIGNING_KEY_FILE, value: /run/secrets/compilesvc/signing-key.pem}
      - {name: COMPILESVC_DRAIN_SECONDS, value: {{ include "compilesvc.workerDrain" (dict "root" $root "pool" $pool) | quote }}}
      {{- if $root.Values.workers.protectPods }}
      - {name: COMPILESVC_KUBERNETES_PROTECT, value: "true"}
      - name: POD_NAMESPACE
        valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
      {{- end }}
      {{- if $neuron }}
      - {name: COMPILESVC_NEURON_SDK, value: {{ $pool.release | quote }}}
      {{- end }}
      - {name: COMPILESVC_SANDBOX_MAX_DISK_MB, value: {{ include "compilesvc.sandboxDisk" (dict "root" $root "pool" $pool) | quote }}}
      {{- if $pod }}
      - {name: COMPILESVC_SANDBOX, value: pod}
      - {name: COMPILESVC_COMPILE_SPOOL, value: /spool}
      {{- else }}
      {{- include "compilesvc.egressEnv" $root | nindent 6 }}
      {{- end }}
      {{- include "compilesvc.secretEnv" (dict "root" $root "component" "worker" "aws" true "required" (list "COMPILESVC_BROKER_URL" "PGPASSWORD") "optional" list) | indent 6 }}
    {{- $resources := include "compilesvc.resources" (dict "name" (printf "workers.pools[%s].resources" $pool.name) "resources" $pool.resources "volumes" (merge (dict "work" $pool.workSizeLimit) (include "compilesvc.scratchSizes" $root | fromYaml))) | fromYaml }}
    {{- if and (not $pod) (gt (int $pool.neuronDevices) 0) }}{{ $_ := set $resources.limits "aws.amazon.com/neuron" $pool.neuronDevices }}{{ end }}
    resources: {{- toYaml $resources | nindent 6 }}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      privileged: false
      runAsNonRoot: true
      capabilities: {drop: [ALL]}
      {{- if $pod }}
      seccompProfile: {type: RuntimeDefault}
      {{- else }}
      # compose's security_opt for bubblewrap (docs/deploy.md, "Compile isolation"): its namespaces and mounts.
      seccompProfile: {type: Unconfined}
      appArmorProfile: {type: Unconfined}
      procMount: Unmasked
      {{- end }}
    volumeMounts:
      - {name: work, mountPath: /var/tmp/compilesvc}  # per-compile work directories
      - {name: signing-key, mountPath: /run/secrets/compilesvc, readOnly: true}
      {{- if $pod }}
      - {name: spool, mountPath: /spool}
      {{- end }}
      {{- if $root.Values.workers.protectPods }}
      # Where an in-cluster client looks (lightkube): the worker's token, the cluster's CA, the namespace.
      - {name: kube-api, mountPath: /var/run/secrets/kubernetes.io/serviceaccount, readOnly: true}
      {{- end }}
      {{- include "compilesvc.scratchMounts" $root | nindent 6 }}
volumes:
  - name: work
    emptyDir: {sizeLimit: {{ $pool.workSizeLimit }}}
  {{- if $pod }}
  - name: spool
    emptyDir: {sizeLimit: {{ $pool.workSizeLimit }}}
  {{- end }}
  {{- include "compilesvc.signingKeyVolume" $root | nindent 2 }}
  {{- include "compilesvc.scratchVolumes" $root | nindent 2 }}
  {{- if $root.Values.workers.protectPods }}
  # automountServiceAccountToken is off (it would reach every container, the compile's too): the worker's
  # token is projected into its container alone, short-lived and rotated by the kubelet.
  - name: kube-api
    projected:
      defaultMode: 0440
      sources:
        - serviceAccountToken: {path: token, expirationSeconds: 3607}
        - configMap: {name: kube-root-ca.crt, items: [{key: ca.crt, path: ca.crt}]}
        - downwardAPI: {items: [{path: namespace, fieldRef: {fieldPath: metadata.namespace}}]}
  {{- end }}
{{- end -}}


{{/* COMPILESVC_SANDBOX_MAX_DISK_MB of a pool: what one compile may leave on disk, below what the kubelet lets the
compile's work directory hold (its emptyDir's sizeLimit: work with bwrap, spool with the pod split; past it the
kubelet evicts the pod without grace, eviction_manager.go emptyDirLimitEviction) shared by the pool's
concurrent compiles, each with its model (up to config.maxUploadBytes) and 1 GiB of headroom. Then the
sandbox's own SANDBOX_DISK_LIMIT fires first. */}}
{{- define "compilesvc.sandboxDisk" -}}
{{- $pool := .pool -}}
{{- if hasKey .root.Values.config.extra "COMPILESVC_SANDBOX_MAX_DISK_MB" -}}
{{- fail "config.extra.COMPILESVC_SANDBOX_MAX_DISK_MB: set workers.pools[].sandboxMaxDiskMb instead (the chart derives it per pool from workSizeLimit)" -}}
{{- end -}}
{{- $upload := include "compilesvc.mib" (.root.Values.config.maxUploadBytes | int64) | int64 -}}
{{- $bound := sub (div (include "compilesvc.mib" $pool.workSizeLimit | int64) (int64 $pool.concurrency)) (add $upload 1024) -}}
{{- if lt $bound 1 -}}
{{- fail (printf "workers.pools[%s].workSizeLimit (%s) leaves no disk for a compile: each of its %d concurrent compiles needs its model (config.maxUploadBytes, %d MiB) plus 1 GiB plus what it writes" $pool.name (toString $pool.workSizeLimit) (int $pool.concurrency) $upload) -}}
{{- end -}}
{{- $wanted := $pool.sandboxMaxDiskMb | default 0 | int64 -}}
{{- if gt $wanted $bound -}}
{{- fail (printf "workers.pools[%s].sandboxMaxDiskMb (%d) is more than its work directory can hold (%d MiB of workSizeLimit %s per compile, less the model and 1 GiB): the kubelet would evict the pod before the sandbox's SANDBOX_DISK_LIMIT fires" $pool.name $wanted $bound (toString $pool.workSizeLimit)) -}}
{{- end -}}
{{- if gt $wanted 0 }}{{ $wanted }}{{ else }}{{ $bound }}{{ end -}}
{{- end -}}
