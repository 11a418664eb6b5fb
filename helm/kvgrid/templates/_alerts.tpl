{{/*
Alert rules (the PrometheusRule's spec; tests/deploy checks them with promtool and evaluates each
signal against a real Prometheus scraping real services). Every expr is written
"(<signal>) <op> <threshold>": the signal alone always returns data while the services run, the
comparison decides whether the alert fires.
*/}}
{{- define "kvgrid.alertRules" -}}
{{- $r := .Values.monitoring.prometheusRule }}
{{- $ctrl := printf "job=%q" (include "kvgrid.controllerJob" .) }}
{{- $agents := printf "job=%q" (include "kvgrid.agentsJob" .) }}
{{- $ns := .Release.Namespace }}
groups:
  - name: kvgrid.rules
    rules:
      {{- if .Values.controller.enabled }}
      - alert: KvgridControllerDown
        expr: (max(up{ {{- $ctrl -}} })) < 1
        for: 2m
        labels:
          severity: critical
        annotations:
          summary: No kvgrid controller of {{ $ns }}/{{ .Release.Name }} is scraped as up
          description: Routers get no answers and agents cannot publish; engines keep serving from their own L1.
      - alert: KvgridControllerNotReady
        expr: (min by (instance) (kvgrid_controller_ready{ {{- $ctrl -}} })) < 1
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: kvgrid controller {{ "{{" }} $labels.instance {{ "}}" }} has not been ready for 10 minutes
          description: Its health stays NOT_SERVING (index backend unreachable, or agents' snapshots not pulled); the Service sends it no traffic.
      - alert: KvgridAgentsNotRegistered
        expr: (count(up{ {{- $agents -}} } == 1) - max(kvgrid_controller_agents{ {{- $ctrl -}} })) > 0
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "{{ "{{" }} $value {{ "}}" }} running kvgrid agents are not registered with the controller"
          description: Their chunks are invisible to routers and peers (agent -> controller connection or TLS identity problem; see the agents' logs).
      - alert: KvgridMatchLatencyHigh
        expr: (histogram_quantile(0.99, sum by (le) (rate(kvgrid_rpc_server_duration_seconds_bucket{ {{- $ctrl -}} ,method=~"MatchPrefix|Score|BatchScore"}[5m])))) > {{ $r.matchLatencyP99Seconds }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "kvgrid controller p99 match latency is {{ "{{" }} $value | humanizeDuration {{ "}}" }}"
          description: Above {{ $r.matchLatencyP99Seconds }} s; routers wait on it before every request.
      - alert: KvgridBackendLost
        expr: (sum(increase(kvgrid_controller_backend_losses_total{ {{- $ctrl -}} }[10m]))) > 0
        labels:
          severity: warning
        annotations:
          summary: The kvgrid index backend (Redis/Valkey) restarted or lost its data
          description: The controller resyncs every agent's snapshot; answers are UNAVAILABLE while the backend is down.
      - alert: KvgridResyncsFrequent
        expr: (sum(rate(kvgrid_controller_resyncs_total{ {{- $ctrl -}} }[15m]))) > {{ $r.resyncsPerSecond }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: kvgrid agents are resynced {{ "{{" }} $value | humanize {{ "}}" }} times a second
          description: Event streams keep breaking (gaps, reconnects); the index lags the agents.
      - alert: KvgridIndexEntriesRejected
        expr: (sum(increase(kvgrid_controller_rejected_entries_total{ {{- $ctrl -}} }[15m]))) > 0
        labels:
          severity: warning
        annotations:
          summary: The kvgrid controller refused index entries (max_entries_per_pod or max_index_entries reached)
          description: Chunks beyond the caps are not routable; raise the caps (controller.config) with the controller's memory limit.
      {{- end }}
      - alert: KvgridRpcErrors
        expr: ((sum by (job, method) (rate(kvgrid_rpc_server_calls_total{code=~"INTERNAL|UNKNOWN|UNAVAILABLE|DATA_LOSS|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED"}[5m])) or sum by (job, method) (rate(kvgrid_rpc_server_calls_total[5m])) * 0) / sum by (job, method) (rate(kvgrid_rpc_server_calls_total[5m]))) > {{ $r.rpcErrorRatio }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "{{ "{{" }} $labels.method {{ "}}" }} on {{ "{{" }} $labels.job {{ "}}" }} fails {{ "{{" }} $value | humanizePercentage {{ "}}" }} of calls"
          description: Server-side gRPC failures (INTERNAL, UNAVAILABLE, ...) above {{ $r.rpcErrorRatio }} of calls.
      - alert: KvgridAgentDown
        expr: (min by (instance) (up{ {{- $agents -}} })) < 1
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: kvgrid agent {{ "{{" }} $labels.instance {{ "}}" }} is not scraped as up
          description: Its engine loses the L1 cache and its chunks are dropped from the index when its lease lapses.
{{- end }}
