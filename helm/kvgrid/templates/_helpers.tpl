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
{{- printf "%s-controller" (include "kvgrid.fullname" .) | trunc 63 | trimSuffix "-" }}
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

{{- define "kvgrid.socketPath" -}}
{{- printf "%s/agent.sock" (trimSuffix "/" .Values.agent.socketDir) }}
{{- end }}

{{/* Name of the Secret the controller reads KVGRID_REDIS_URL from ("" = none). */}}
{{- define "kvgrid.redisSecretName" -}}
{{- $redis := .Values.controller.index.redis }}
{{- if eq .Values.controller.index.backend "redis" }}
{{- if $redis.existingSecret }}
{{- $redis.existingSecret }}
{{- else if $redis.url }}
{{- printf "%s-redis" (include "kvgrid.controllerName" .) }}
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
{{- define "kvgrid.podEnv" -}}
- name: POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
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
{{- range $k, $v := .Values.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%v" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if .Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otel.endpoint | quote }}
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

{{/* Pod annotations for an engine pod carrying the agent sidecar (scrape the agent's metrics). */}}
{{- define "kvgrid.agentPodAnnotations" -}}
{{- include "kvgrid.scrapeAnnotations" (dict "root" . "port" .Values.agent.metricsPort) }}
{{- end }}

{{/* `kvgrid agent` arguments: every flag is a real AgentConfig field (see `kvgrid agent --help`). */}}
{{- define "kvgrid.agentArgs" -}}
- agent
- {{ printf "--uds-path=%s" (include "kvgrid.socketPath" .) | quote }}
- {{ printf "--tcp-port=%d" (int .Values.agent.port) | quote }}
- {{ printf "--l1-size=%v" .Values.agent.l1Size | quote }}
- {{ printf "--eviction-policy=%v" .Values.agent.evictionPolicy | quote }}
- {{ printf "--log-level=%v" .Values.agent.logLevel | quote }}
{{- if .Values.metrics.enabled }}
- {{ printf "--prometheus-port=%d" (int .Values.agent.metricsPort) | quote }}
{{- end }}
{{- with include "kvgrid.controllerAddress" . }}
- {{ printf "--controller-address=%v" . | quote }}
{{- end }}
{{- range .Values.agent.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
The agent sidecar container. It is a native sidecar (restartPolicy: Always): put it under the
engine pod's initContainers, so it is up (startupProbe) before the engine starts and stops after it.
*/}}
{{- define "kvgrid.agentSidecar" -}}
- name: kvgrid-agent
  image: {{ include "kvgrid.image" (dict "image" .Values.agent.image "root" .) | quote }}
  imagePullPolicy: {{ .Values.agent.image.pullPolicy }}
  restartPolicy: Always
  command: [kvgrid]
  args:
    {{- include "kvgrid.agentArgs" . | nindent 4 }}
  env:
    {{- include "kvgrid.podEnv" . | nindent 4 }}
    {{- if .Values.agent.nvidiaVisibleDevices }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ .Values.agent.nvidiaVisibleDevices | quote }}
    {{- end }}
    # Triton compiles kernels at first use; the root filesystem is read-only.
    - name: TRITON_CACHE_DIR
      value: /tmp/triton
    - name: HOME
      value: /tmp
    {{- with .Values.agent.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: kvgrid-agent
      containerPort: {{ .Values.agent.port }}
      protocol: TCP
    {{- if .Values.metrics.enabled }}
    - name: agent-metrics
      containerPort: {{ .Values.agent.metricsPort }}
      protocol: TCP
    {{- end }}
  startupProbe:
    grpc:
      port: {{ .Values.agent.port }}
    periodSeconds: 2
    failureThreshold: 150
  readinessProbe:
    grpc:
      port: {{ .Values.agent.port }}
    periodSeconds: 10
  livenessProbe:
    grpc:
      port: {{ .Values.agent.port }}
    periodSeconds: 20
    failureThreshold: 3
  volumeMounts:
    - name: kvgrid-socket
      mountPath: {{ .Values.agent.socketDir }}
    - name: kvgrid-tmp
      mountPath: /tmp
    {{- if .Values.agent.shm.enabled }}
    - name: kvgrid-shm
      mountPath: /dev/shm
    {{- end }}
  {{- with .Values.agent.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.agent.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
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
    sizeLimit: {{ .Values.agent.shm.sizeLimit }}
{{- end }}
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
{{- end }}
- {{ printf "--lease-ttl-ms=%d" (int .Values.controller.leaseTtlMs) | quote }}
- {{ printf "--grpc-workers=%d" (int .Values.controller.grpcWorkers) | quote }}
- {{ printf "--log-level=%v" .Values.controller.logLevel | quote }}
{{- if .Values.metrics.enabled }}
- {{ printf "--prometheus-port=%d" (int .Values.controller.metricsPort) | quote }}
{{- end }}
{{- if .Values.controller.config }}
- "--config=/etc/kvgrid/controller.yaml"
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
{{- if and $c.enabled (eq $c.index.backend "redis") (not $c.index.redis.url) (not $c.index.redis.existingSecret) }}
{{- fail "controller.index.backend=redis needs controller.index.redis.url (e.g. redis://valkey:6379/0) or controller.index.redis.existingSecret naming a Secret that holds the URL" }}
{{- end }}
{{- range $key := list "listen" "index_backend" "redis_url" "redis_prefix" "lease_ttl_ms" "grpc_workers" "prometheus_port" }}
{{- if hasKey $c.config $key }}
{{- fail (printf "controller.config.%s is set by the chart (a flag wins over the config file); use the dedicated value instead (see values.yaml: controller.port, controller.index.*, controller.leaseTtlMs, controller.grpcWorkers, controller.metricsPort)" $key) }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.agent.metricsPort) (int .Values.agent.port)) }}
{{- fail (printf "agent.metricsPort=%d equals agent.port: expected two different ports" (int .Values.agent.port)) }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int $c.metricsPort) (int $c.port)) }}
{{- fail (printf "controller.metricsPort=%d equals controller.port: expected two different ports" (int $c.port)) }}
{{- end }}
{{- end }}
