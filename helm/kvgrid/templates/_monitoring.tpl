{{/*
Monitoring helpers. The ServiceMonitor scrapes the controller Service (Prometheus' job label is the
Service name); the PodMonitor scrapes every agent sidecar of engine pods labelled with
kvgrid.agentPodLabels (job label <namespace>/<PodMonitor name>). Alerts select by those jobs.
*/}}

{{/* true when a monitoring.coreos.com/v1 object of this kind should render; call with (dict "root" $ "value" <auto|true|false>). */}}
{{- define "kvgrid.monitoringOn" -}}
{{- if and .root.Values.metrics.enabled (or (eq (toString .value) "true") (and (eq (toString .value) "auto") (.root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"))) }}true{{ end }}
{{- end }}

{{- define "kvgrid.controllerJob" -}}
{{- include "kvgrid.controllerName" . }}
{{- end }}

{{- define "kvgrid.agentsMonitorName" -}}
{{- include "kvgrid.componentName" (dict "root" . "suffix" "agents") }}
{{- end }}

{{- define "kvgrid.agentsJob" -}}
{{- printf "%s/%s" .Release.Namespace (include "kvgrid.agentsMonitorName" .) }}
{{- end }}
