{{/*
Named templates. Every template takes a chart root context: `.` inside this chart, or
`.Subcharts.kvgrid` from a parent chart that lists kvgrid as a dependency (that context carries
kvgrid's own .Values, .Chart and the parent's .Release).
*/}}

{{- define "kvgrid.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgrid.fullname" -}}
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

{{- define "kvgrid.controllerName" -}}
{{- include "kvgrid.componentName" (dict "root" . "suffix" "controller") }}
{{- end }}

{{/* Labels shared by every object; the component label is added per object. */}}
{{- define "kvgrid.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvgrid.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgrid
{{- end }}

{{/* Selector labels; call with (dict "root" $ "component" "controller"). */}}
{{- define "kvgrid.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgrid.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image reference; call with (dict "image" .Values.x.image "root" $). Empty tag = appVersion. */}}
{{- define "kvgrid.image" -}}
{{- $ref := printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- if .image.digest }}
{{- $ref = printf "%s@%s" $ref .image.digest }}
{{- end }}
{{- $ref }}
{{- end }}

{{/* host:port the agents stream events to ("" = none). */}}
{{- define "kvgrid.controllerAddress" -}}
{{- if .Values.agent.controllerAddress }}
{{- .Values.agent.controllerAddress }}
{{- else if .Values.controller.enabled }}
{{- printf "%s.%s.svc:%d" (include "kvgrid.controllerName" .) .Release.Namespace (int .Values.controller.port) }}
{{- end }}
{{- end }}

{{/* The socket the connector names: with several sidecars, vLLM's '{rank}' picks each worker's. */}}
{{- define "kvgrid.socketPath" -}}
{{- if gt (int .Values.agent.sidecarsPerPod) 1 }}
{{- printf "%s/agent-{rank}.sock" (trimSuffix "/" .Values.agent.socketDir) }}
{{- else }}
{{- printf "%s/agent.sock" (trimSuffix "/" .Values.agent.socketDir) }}
{{- end }}
{{- end }}

{{/*
Per-sidecar names. With agent.sidecarsPerPod=1 (one agent for the pod's engine) they are the plain
ones; with N > 1 (one agent per GPU of a TP=N engine) sidecar i gets an -<i> suffix, port + i,
metricsPort + i, socket agent-<i>.sock and the pod identity <pod uid>-gpu<i>, so the controller
sees N agents. Call each with (dict "root" $ "i" <int>).
*/}}
{{- define "kvgrid.agentMulti" -}}
{{- if gt (int .Values.agent.sidecarsPerPod) 1 }}true{{ end }}
{{- end }}

{{- define "kvgrid.agentContainerName" -}}
{{- if include "kvgrid.agentMulti" .root }}{{ printf "kvgrid-agent-%d" (int .i) }}{{ else }}kvgrid-agent{{ end }}
{{- end }}

{{- define "kvgrid.agentUidSuffix" -}}
{{- if include "kvgrid.agentMulti" .root }}{{ printf "-gpu%d" (int .i) }}{{ end }}
{{- end }}

{{/* call with (dict "root" $ "i" <int> "base" "kvgrid-tls") */}}
{{- define "kvgrid.agentVolumeName" -}}
{{- if include "kvgrid.agentMulti" .root }}{{ printf "%s-%d" .base (int .i) }}{{ else }}{{ .base }}{{ end }}
{{- end }}

{{- define "kvgrid.agentSocketPath" -}}
{{- $dir := trimSuffix "/" .root.Values.agent.socketDir }}
{{- if include "kvgrid.agentMulti" .root }}{{ printf "%s/agent-%d.sock" $dir (int .i) }}{{ else }}{{ printf "%s/agent.sock" $dir }}{{ end }}
{{- end }}

{{- define "kvgrid.agentPort" -}}
{{- add (int .root.Values.agent.port) (int .i) }}
{{- end }}

{{- define "kvgrid.agentDataPort" -}}
{{- add (int .root.Values.agent.peerDataPort) (int .i) }}
{{- end }}

{{- define "kvgrid.agentMetricsPort" -}}
{{- add (int .root.Values.agent.metricsPort) (int .i) }}
{{- end }}

{{- define "kvgrid.agentMetricsPortName" -}}
{{- if include "kvgrid.agentMulti" .root }}{{ printf "agent-metrics-%d" (int .i) }}{{ else }}agent-metrics{{ end }}
{{- end }}

{{/* Labels an engine pod with agent sidecars carries: the NetworkPolicies and the PodMonitor select them. */}}
{{- define "kvgrid.agentPodLabels" -}}
kvgrid.io/agent-of: {{ .Release.Name | quote }}
{{- end }}

{{/* Name of the Secret the controller reads KVGRID_REDIS_URL from ("" = none). */}}
{{- define "kvgrid.redisSecretName" -}}
{{- $redis := .Values.controller.index.redis }}
{{- if eq .Values.controller.index.backend "redis" }}
{{- if $redis.existingSecret }}
{{- $redis.existingSecret }}
{{- else if $redis.url }}
{{- include "kvgrid.componentName" (dict "root" . "suffix" "controller-redis") }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgrid.redisSecretKey" -}}
{{- if .Values.controller.index.redis.existingSecret }}
{{- .Values.controller.index.redis.existingSecretKey }}
{{- else }}
{{- "redis-url" }}
{{- end }}
{{- end }}

{{/* Downward-API identity (read by kvgrid.common.identity.PodIdentity.from_env) plus OTel env. */}}
{{/*
Call with the root context, or with (dict "root" $ "uidSuffix" "-gpu0") for one of several agents in
a pod: each then registers as its own pod identity <pod uid><suffix>.
*/}}
{{- define "kvgrid.podEnv" -}}
{{- $root := . }}
{{- $suffix := "" }}
{{- if hasKey . "uidSuffix" }}
{{- $root = .root }}
{{- $suffix = .uidSuffix }}
{{- end }}
{{- if $suffix }}
- name: K8S_POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: POD_UID
  value: {{ printf "$(K8S_POD_UID)%s" $suffix | quote }}
{{- else }}
- name: POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- $attrs := list "k8s.pod.uid=$(POD_UID)" "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.node.name=$(NODE_NAME)" }}
{{- range $k, $v := $root.Values.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%v" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if $root.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $root.Values.otel.endpoint | quote }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations; call with (dict "root" $ "port" <int>). */}}
{{- define "kvgrid.scrapeAnnotations" -}}
{{- if .root.Values.metrics.enabled -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
Pod annotations for an engine pod carrying the agent sidecar. Empty unless
metrics.agentScrapeAnnotations: prometheus.io/port names one port per pod, and on an engine pod that
port belongs to vLLM's own /metrics. The agents are scraped through the PodMonitor (named ports)
instead; see docs/deploy.md.
*/}}
{{- define "kvgrid.agentPodAnnotations" -}}
{{- if .Values.metrics.agentScrapeAnnotations }}
{{- include "kvgrid.scrapeAnnotations" (dict "root" . "port" .Values.agent.metricsPort) }}
{{- end }}
{{- end }}

{{/* `kvgrid agent` arguments of sidecar i: real AgentConfig fields (see `kvgrid agent --help`). */}}
{{- define "kvgrid.agentArgs" -}}
{{- $v := .root.Values }}
- agent
- {{ printf "--uds-path=%s" (include "kvgrid.agentSocketPath" .) | quote }}
- {{ printf "--tcp-port=%s" (include "kvgrid.agentPort" .) | quote }}
- {{ printf "--l1-size=%v" $v.agent.l1Size | quote }}
{{- if $v.agent.l1Shared }}
{{- /* The L1 file lies in the kvgrid-shm emptyDir, which the engine mounts at /dev/shm too. */}}
- "--l1-shared-dir=/dev/shm"
{{- end }}
- {{ printf "--eviction-policy=%v" $v.agent.evictionPolicy | quote }}
- {{ printf "--peer-data-plane=%v" $v.agent.peerDataPlane | quote }}
{{- if ne (include "kvgrid.tlsProvider" .root) "off" }}
- {{ printf "--peer-data-security=%v" $v.agent.peerDataSecurity | quote }}
{{- end }}
- {{ printf "--peer-fetch-mode=%v" $v.agent.peerFetchMode | quote }}
- {{ printf "--peer-data-port=%s" (include "kvgrid.agentDataPort" .) | quote }}
- {{ printf "--log-level=%v" $v.agent.logLevel | quote }}
{{- if eq (include "kvgrid.tlsProvider" .root) "off" }}
{{- /* Without TLS the agent listens on loopback only unless told so explicitly (docs/security.md). */}}
- "--insecure-plaintext-on-network"
{{- end }}
{{- if $v.metrics.enabled }}
- {{ printf "--prometheus-port=%s" (include "kvgrid.agentMetricsPort" .) | quote }}
{{- end }}
{{- include "kvgrid.agentTierArgs" . }}
{{- with include "kvgrid.controllerAddress" .root }}
- {{ printf "--controller-address=%v" . | quote }}
{{- end }}
{{- range $v.agent.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The lower tiers' flags (agent.tiers): disk and object store when configured. */}}
{{- define "kvgrid.agentTierArgs" -}}
{{- $t := .root.Values.agent.tiers }}
- {{ printf "--tier-promotion=%v" $t.promotion | quote }}
{{- if $t.disk.path }}
- {{ printf "--tier-disk-path=%s" (include "kvgrid.agentTierDiskPath" .) | quote }}
- {{ printf "--tier-disk-size=%v" $t.disk.size | quote }}
{{- end }}
{{- if $t.s3.endpoint }}
- {{ printf "--tier-s3-endpoint=%v" $t.s3.endpoint | quote }}
- {{ printf "--tier-s3-bucket=%v" $t.s3.bucket | quote }}
- {{ printf "--tier-s3-prefix=%v" $t.s3.prefix | quote }}
- {{ printf "--tier-s3-size=%v" $t.s3.size | quote }}
{{- if $t.s3.region }}
- {{ printf "--tier-s3-region=%v" $t.s3.region | quote }}
{{- end }}
{{- if $t.s3.credentialsSecret }}
- {{ printf "--tier-s3-credentials-dir=%s" (include "kvgrid.agentTierS3Dir" .root) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Disk tier directory of sidecar .i: the volume's mount path, or a subdirectory per sidecar. */}}
{{- define "kvgrid.agentTierDiskPath" -}}
{{- $p := trimSuffix "/" .root.Values.agent.tiers.disk.path }}
{{- if include "kvgrid.agentMulti" .root }}{{ printf "%s/agent-%d" $p (int .i) }}{{ else }}{{ $p }}{{ end }}
{{- end }}

{{- define "kvgrid.agentTierS3Dir" -}}/etc/kvgrid/tier-s3{{- end }}

{{/* Mounts of the tier volumes in a sidecar. */}}
{{- define "kvgrid.agentTierMounts" -}}
{{- $t := .Values.agent.tiers }}
{{- if $t.disk.path }}
- name: kvgrid-tier-disk
  mountPath: {{ trimSuffix "/" $t.disk.path }}
{{- end }}
{{- if and $t.s3.endpoint $t.s3.credentialsSecret }}
- name: kvgrid-tier-s3
  mountPath: {{ include "kvgrid.agentTierS3Dir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The tier volumes of the engine pod: the disk tier's and the object store's credentials. */}}
{{- define "kvgrid.agentTierVolumes" -}}
{{- $t := .Values.agent.tiers }}
{{- if $t.disk.path }}
- name: kvgrid-tier-disk
{{- if eq $t.disk.volume.type "hostPath" }}
  hostPath:
    path: {{ $t.disk.volume.hostPath }}
    type: DirectoryOrCreate
{{- else if eq $t.disk.volume.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ $t.disk.volume.claimName }}
{{- else }}
  {{- /* Room for every sidecar's tier plus file-system blocks and headers. */}}
  {{- $bytes := mulf (include "kvgrid.bytes" $t.disk.size | float64) (int .Values.agent.sidecarsPerPod) 1.1 }}
  emptyDir:
    sizeLimit: {{ $bytes | floor | int64 }}
{{- end }}
{{- end }}
{{- if and $t.s3.endpoint $t.s3.credentialsSecret }}
- name: kvgrid-tier-s3
  secret:
    secretName: {{ $t.s3.credentialsSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/*
The agent sidecar containers (agent.sidecarsPerPod of them). They are native sidecars
(restartPolicy: Always): put them under the engine pod's initContainers, so they are up
(startupProbe) before the engine starts and stop after it.
*/}}
{{- define "kvgrid.agentSidecar" -}}
{{- $root := . }}
{{- range $i := until (int .Values.agent.sidecarsPerPod) }}
{{- $c := dict "root" $root "i" $i }}
{{- $port := include "kvgrid.agentPort" $c | int }}
- name: {{ include "kvgrid.agentContainerName" $c }}
  image: {{ include "kvgrid.image" (dict "image" $root.Values.agent.image "root" $root) | quote }}
  imagePullPolicy: {{ $root.Values.agent.image.pullPolicy }}
  restartPolicy: Always
  command: [kvgrid]
  args:
    {{- include "kvgrid.agentArgs" $c | nindent 4 }}
  env:
    {{- if include "kvgrid.agentMulti" $root }}
    {{- include "kvgrid.podEnv" (dict "root" $root "uidSuffix" (include "kvgrid.agentUidSuffix" $c)) | nindent 4 }}
    {{- else }}
    {{- include "kvgrid.podEnv" $root | nindent 4 }}
    {{- end }}
    {{- include "kvgrid.tlsEnv" $root | nindent 4 }}
    {{- with include "kvgrid.podTokenEnv" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if $root.Values.agent.nvidiaVisibleDevices }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ $root.Values.agent.nvidiaVisibleDevices | quote }}
    {{- end }}
    # Triton compiles kernels at first use; the root filesystem is read-only.
    - name: TRITON_CACHE_DIR
      value: /tmp/triton
    - name: HOME
      value: /tmp
    {{- with $root.Values.agent.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ printf "kvgrid-agent%s" (ternary (printf "-%d" $i) "" (eq (include "kvgrid.agentMulti" $root) "true")) }}
      containerPort: {{ $port }}
      protocol: TCP
    {{- if $root.Values.metrics.enabled }}
    - name: {{ include "kvgrid.agentMetricsPortName" $c }}
      containerPort: {{ include "kvgrid.agentMetricsPort" $c }}
      protocol: TCP
    {{- end }}
  {{- /* The kubelet's gRPC probe cannot do mTLS: with TLS on, the agent's port is probed by TCP
  connect (the agent has no plaintext health port yet; the controller has, see controller.healthPort). */}}
  {{- $probe := ternary (dict "grpc" (dict "port" $port)) (dict "tcpSocket" (dict "port" $port)) (eq (include "kvgrid.tlsProvider" $root) "off") }}
  startupProbe:
    {{- toYaml $probe | nindent 4 }}
    periodSeconds: 2
    failureThreshold: 150
  readinessProbe:
    {{- toYaml $probe | nindent 4 }}
    periodSeconds: 10
  livenessProbe:
    {{- toYaml $probe | nindent 4 }}
    periodSeconds: 20
    failureThreshold: 3
  volumeMounts:
    - name: kvgrid-socket
      mountPath: {{ $root.Values.agent.socketDir }}
    - name: kvgrid-tmp
      mountPath: /tmp
    {{- if $root.Values.agent.shm.enabled }}
    - name: kvgrid-shm
      mountPath: /dev/shm
    {{- end }}
    {{- with include "kvgrid.agentTierMounts" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- $tlsVolume := ternary (include "kvgrid.agentVolumeName" (dict "root" $root "i" $i "base" "kvgrid-tls")) "kvgrid-tls" (eq $root.Values.tls.agentIdentity "perPod") }}
    {{- include "kvgrid.tlsVolumeMount" (dict "root" $root "volume" $tlsVolume) | nindent 4 }}
    {{- with include "kvgrid.podTokenMount" $root }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.agent.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.agent.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Volumes the sidecar needs; add them to the engine pod's volumes. */}}
{{- define "kvgrid.agentVolumes" -}}
- name: kvgrid-socket
  emptyDir: {}
- name: kvgrid-tmp
  emptyDir: {}
{{- if .Values.agent.shm.enabled }}
- name: kvgrid-shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ include "kvgrid.quantity" .Values.agent.shm.sizeLimit }}
{{- end }}
{{- with include "kvgrid.agentTierVolumes" . | trim }}
{{ . }}
{{- end }}
{{- include "kvgrid.agentTlsVolumes" . }}
{{- end }}

{{/*
Pod Security "restricted" for an engine pod with the agent sidecar: put it under the pod's
spec.securityContext. The engine runs as the agent's uid and gid (agent.securityContext, 65532: the
agent creates the socket and the shared L1 file for its own uid); fsGroup (tls.fsGroup) makes the
certificate Secret's files (mode 0440) readable by the agent; RuntimeDefault seccomp for every
container. An engine image that needs another uid must still run as the agent's to use its socket.
*/}}
{{- define "kvgrid.enginePodSecurityContext" -}}
{{- $sc := default (dict) .Values.agent.securityContext -}}
runAsNonRoot: true
runAsUser: {{ default 65532 $sc.runAsUser | int64 }}
runAsGroup: {{ default 65532 $sc.runAsGroup | int64 }}
fsGroup: {{ .Values.tls.fsGroup | int64 }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The engine container's securityContext for Pod Security "restricted" (with kvgrid.enginePodSecurityContext). */}}
{{- define "kvgrid.engineSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end }}

{{/* Volume mounts for the engine container: the agent's socket directory and the shared /dev/shm. */}}
{{- define "kvgrid.engineVolumeMounts" -}}
- name: kvgrid-socket
  mountPath: {{ .Values.agent.socketDir }}
{{- if .Values.agent.shm.enabled }}
- name: kvgrid-shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* The vLLM --kv-transfer-config JSON that loads KVGridConnector. */}}
{{- define "kvgrid.kvTransferConfig" -}}
{{- $extra := merge (dict "agent_socket" (include "kvgrid.socketPath" .)) (deepCopy .Values.examples.vllm.connectorExtraConfig) }}
{{- dict "kv_connector" "KVGridConnector" "kv_connector_module_path" "kvgrid.connector.vllm" "kv_role" .Values.examples.vllm.kvRole "kv_connector_extra_config" $extra | toJson }}
{{- end }}

{{/* `kvgrid controller` arguments: real ControllerConfig fields (see `kvgrid controller --help`). */}}
{{- define "kvgrid.controllerArgs" -}}
- controller
- {{ printf "--listen=0.0.0.0:%d" (int .Values.controller.port) | quote }}
- {{ printf "--index-backend=%v" .Values.controller.index.backend | quote }}
{{- if eq .Values.controller.index.backend "redis" }}
- {{ printf "--redis-prefix=%v" .Values.controller.index.redis.prefix | quote }}
- {{ printf "--redis-cluster=%v" (.Values.controller.index.redis.cluster | default false) | quote }}
{{- end }}
- {{ printf "--lease-ttl-ms=%d" (int .Values.controller.leaseTtlMs) | quote }}
- {{ printf "--grpc-workers=%d" (int .Values.controller.grpcWorkers) | quote }}
- {{ printf "--log-level=%v" .Values.controller.logLevel | quote }}
{{- if .Values.metrics.enabled }}
- {{ printf "--prometheus-port=%d" (int .Values.controller.metricsPort) | quote }}
{{- end }}
{{- if ne (include "kvgrid.tlsProvider" .) "off" }}
- {{ printf "--health-port=%d" (int .Values.controller.healthPort) | quote }}
- {{ printf "--agent-pod-proof=%s" (include "kvgrid.agentPodProof" .) | quote }}
{{- if include "kvgrid.podTokens" . }}
- {{ printf "--agent-token-audience=%s" .Values.tls.podToken.audience | quote }}
- {{ printf "--agent-token-cache-ms=%d" (int .Values.tls.podToken.cacheMs) | quote }}
{{- end }}
{{- else }}
{{- /* Without TLS a non-loopback --listen is refused unless said explicitly (docs/security.md). */}}
- "--insecure-plaintext-on-network"
{{- end }}
{{- /* The lookup listener binds the --listen host; it is mTLS with TLS on, else plaintext like gRPC. */}}
- {{ printf "--lookup-port=%d" (int .Values.controller.lookupPort) | quote }}
{{- $r := .Values.controller.readiness }}
{{- $settle := ternary 10000 0 (eq .Values.controller.index.backend "memory") }}
{{- if not (kindIs "invalid" $r.settleMs) }}
{{- $settle = int $r.settleMs }}
{{- end }}
- {{ printf "--readiness-settle-ms=%d" $settle | quote }}
- {{ printf "--readiness-max-wait-ms=%d" (int $r.maxWaitMs) | quote }}
{{- $sc := .Values.controller.scoring }}
{{- $l2Tier := $sc.l2Tier }}
{{- if not $l2Tier }}
{{- $l2Tier = ternary "object_store" "disk" (and (not .Values.agent.tiers.disk.path) (ne .Values.agent.tiers.s3.endpoint "")) }}
{{- end }}
- {{ printf "--l2-tier=%s" $l2Tier | quote }}
- {{ printf "--l2-disk-gbps=%v" $sc.l2DiskGbps | quote }}
- {{ printf "--l2-object-store-gbps=%v" $sc.l2ObjectStoreGbps | quote }}
{{- if .Values.controller.config }}
- "--config=/etc/kvgrid/config/controller.yaml"
{{- end }}
{{- range .Values.controller.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Rules that span several values (types, ranges and enums are in values.schema.json). */}}
{{- define "kvgrid.validate" -}}
{{- $c := .Values.controller }}
{{- if and $c.enabled (gt (int $c.replicas) 1) (ne $c.index.backend "redis") }}
{{- fail (printf "controller.replicas=%d needs controller.index.backend=redis: the %s index lives inside one controller process, so replicas would each answer from a different index. Set controller.index.backend=redis with controller.index.redis.url (or existingSecret), or controller.replicas=1." (int $c.replicas) $c.index.backend) }}
{{- end }}
{{- if and $c.enabled $c.index.redis.cluster (ne $c.index.backend "redis") }}
{{- fail (printf "controller.index.redis.cluster=true needs controller.index.backend=redis (it is %s)" $c.index.backend) }}
{{- end }}
{{- if and $c.enabled (eq $c.index.backend "redis") (not $c.index.redis.url) (not $c.index.redis.existingSecret) }}
{{- fail "controller.index.backend=redis needs controller.index.redis.url (e.g. redis://valkey:6379/0) or controller.index.redis.existingSecret naming a Secret that holds the URL" }}
{{- end }}
{{- range $key := list "listen" "index_backend" "redis_url" "redis_prefix" "redis_cluster" "lease_ttl_ms" "grpc_workers" "prometheus_port" "health_port" "lookup_port" "readiness_settle_ms" "readiness_max_wait_ms" "tls_cert_file" "tls_key_file" "tls_ca_file" "tls_trust_domain" "agent_pod_proof" "agent_token_audience" "agent_token_cache_ms" }}
{{- if hasKey $c.config $key }}
{{- fail (printf "controller.config.%s is set by the chart (a flag wins over the config file); use the dedicated value instead (see values.yaml: controller.port, controller.index.*, controller.leaseTtlMs, controller.grpcWorkers, controller.metricsPort, controller.healthPort, controller.lookupPort, controller.readiness.*, tls.*)" $key) }}
{{- end }}
{{- end }}
{{- $n := int .Values.agent.sidecarsPerPod }}
{{- if and .Values.metrics.enabled (eq (int .Values.agent.metricsPort) (int .Values.agent.port)) }}
{{- fail (printf "agent.metricsPort=%d equals agent.port: expected two different ports" (int .Values.agent.port)) }}
{{- end }}
{{- $p := int .Values.agent.port }}
{{- $mp := int .Values.agent.metricsPort }}
{{- if and .Values.metrics.enabled (gt $n 1) (lt $p (add $mp $n)) (lt $mp (add $p $n)) }}
{{- fail (printf "agent.sidecarsPerPod=%d uses ports %d-%d and metrics ports %d-%d, which overlap: expected agent.port and agent.metricsPort at least %d apart" $n $p (add $p $n -1) $mp (add $mp $n -1) $n) }}
{{- end }}
{{- with .Values.agent.resources }}
{{- with .limits }}
{{- if .memory }}
{{- $l1 := include "kvgrid.bytes" $.Values.agent.l1Size | float64 }}
{{- $mem := include "kvgrid.bytes" .memory | float64 }}
{{- if ge $l1 $mem }}
{{- fail (printf "agent.l1Size=%v does not fit agent.resources.limits.memory=%v: the L1 pool is allocated at start, so the agent would be OOM-killed. Expected an L1 smaller than the memory limit (leave ~1-2Gi for the process), e.g. a limit of %dGi or a smaller l1Size" $.Values.agent.l1Size .memory (add 2 (ceil (divf $l1 1073741824.0) | int))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.agent.l1Shared }}
{{- if not .Values.agent.shm.enabled }}
{{- fail "agent.l1Shared=true needs agent.shm.enabled=true: the shared L1 file lives in the /dev/shm emptyDir that the sidecar and the engine both mount (agent.shm)" }}
{{- end }}
{{- /* Each agent's file is its pool plus one 64Ki page (alignment); a tmpfs cannot hold more than sizeLimit. */}}
{{- $file := addf (include "kvgrid.bytes" .Values.agent.l1Size | float64) 65536.0 }}
{{- $need := mulf $file $n }}
{{- $shm := include "kvgrid.bytes" .Values.agent.shm.sizeLimit | float64 }}
{{- if lt $shm $need }}
{{- fail (printf "agent.l1Shared=true with agent.shm.sizeLimit=%v: the /dev/shm emptyDir must hold agent.sidecarsPerPod=%d L1 file(s) of agent.l1Size=%v plus 64Ki each (%d bytes), or the agent cannot allocate its L1 at start. Expected agent.shm.sizeLimit of at least %dGi (plus what the engine keeps in /dev/shm), or a smaller agent.l1Size" .Values.agent.shm.sizeLimit $n .Values.agent.l1Size ($need | int64) (ceil (divf $need 1073741824.0) | int)) }}
{{- end }}
{{- end }}
{{- $tiers := .Values.agent.tiers }}
{{- if and $tiers.s3.endpoint (not $tiers.s3.bucket) }}
{{- fail (printf "agent.tiers.s3.endpoint=%s needs agent.tiers.s3.bucket: expected the name of an existing bucket" $tiers.s3.endpoint) }}
{{- end }}
{{- if and $tiers.disk.path (eq $tiers.disk.volume.type "hostPath") (not $tiers.disk.volume.hostPath) }}
{{- fail "agent.tiers.disk.volume.type=hostPath needs agent.tiers.disk.volume.hostPath: expected a node directory such as /mnt/nvme/kvgrid" }}
{{- end }}
{{- if and $tiers.disk.path (eq $tiers.disk.volume.type "persistentVolumeClaim") (not $tiers.disk.volume.claimName) }}
{{- fail "agent.tiers.disk.volume.type=persistentVolumeClaim needs agent.tiers.disk.volume.claimName: expected the name of an existing PersistentVolumeClaim" }}
{{- end }}
{{- $tls := include "kvgrid.tlsProvider" . }}
{{- if eq .Values.tls.agentIdentity "shared" }}
{{- fail "tls.agentIdentity=shared is no longer a choice: one shared agent certificate lets any agent pod register, heartbeat and publish as any other pod. Expected podToken (the default: the shared certificate plus each pod's ServiceAccount token, verified by the controller), perPod (cert-manager's csi-driver) or, to keep the old behaviour knowingly, sharedCertificateUnverified (docs/security.md, \"Agent identity modes\")" }}
{{- end }}
{{- if and (eq .Values.tls.agentIdentity "perPod") (ne $tls "cert-manager") }}
{{- fail (printf "tls.agentIdentity=perPod needs certificates from cert-manager's csi-driver (csi.cert-manager.io), got tls provider %q: expected tls.provider=auto on a cluster with cert-manager, or tls.provider=cert-manager, or tls.agentIdentity=podToken (the default; certificates Helm makes carry no per-pod identity, pod ServiceAccount tokens prove the pod instead)" $tls) }}
{{- end }}
{{- if eq $tls "existingSecrets" }}
{{- range $role := list "controller" "agent" }}
{{- if not (get $.Values.tls.existingSecrets $role) }}
{{- fail (printf "tls.provider=existingSecrets needs tls.existingSecrets.%s: the name of a Secret with tls.crt, tls.key and ca.crt whose URI SAN is %s (or, without a kvgrid URI SAN, whose DNS SAN is %s)" $role (include "kvgrid.spiffeId" (dict "root" $ "role" $role)) (include "kvgrid.dnsId" (dict "root" $ "role" $role))) }}
{{- end }}
{{- end }}
{{- end }}
{{- $ex := .Values.examples.vllm }}
{{- if and $ex.enabled (gt $n 1) (ne $n (int $ex.gpus)) }}
{{- fail (printf "agent.sidecarsPerPod=%d with examples.vllm.gpus=%d: one agent per GPU needs as many sidecars as the engine has GPUs (tensor-parallel ranks); expected sidecarsPerPod=%d, or 1 (one agent for the pod)" $n (int $ex.gpus) (int $ex.gpus)) }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int $c.metricsPort) (int $c.port)) }}
{{- fail (printf "controller.metricsPort=%d equals controller.port: expected two different ports" (int $c.port)) }}
{{- end }}
{{- if or (eq (int $c.healthPort) (int $c.port)) (and .Values.metrics.enabled (eq (int $c.healthPort) (int $c.metricsPort))) }}
{{- fail (printf "controller.healthPort=%d equals controller.port or controller.metricsPort: expected its own port" (int $c.healthPort)) }}
{{- end }}
{{- $lp := int $c.lookupPort }}
{{- if and (gt $lp 0) (or (eq $lp (int $c.port)) (eq $lp (int $c.healthPort)) (and .Values.metrics.enabled (eq $lp (int $c.metricsPort)))) }}
{{- fail (printf "controller.lookupPort=%d equals controller.port, controller.healthPort or controller.metricsPort: expected its own port (or 0: no lookup listener)" $lp) }}
{{- end }}
{{- end }}
