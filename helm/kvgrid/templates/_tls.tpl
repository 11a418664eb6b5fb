{{/*
TLS: where the certificates come from and how pods get them.

Identities are SPIFFE IDs in the certificates' URI SAN (the services authorize by them):
  spiffe://<tls.trustDomain>/ns/<release namespace>/role/{controller,router,agent}
  spiffe://<tls.trustDomain>/ns/<release namespace>/role/agent/pod/<pod uid>   (tls.agentIdentity=perPod)
Every certificate is mounted at /etc/kvgrid/tls/{tls.crt,tls.key,ca.crt} (cert-manager's Secret
layout) and named to the services through KVGRID_TLS_* env. Rotation replaces the mounted files in
place and the services reload them, so nothing here restarts pods for a new certificate.
*/}}

{{/* "cert-manager" | "existingSecrets" | "off" */}}
{{- define "kvgrid.tlsProvider" -}}
{{- $t := .Values.tls }}
{{- if not $t.enabled }}
{{- "off" }}
{{- else if eq $t.provider "auto" }}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" }}
{{- "cert-manager" }}
{{- else }}
{{- fail "tls.enabled=true needs certificates, and this cluster has no cert-manager (API cert-manager.io/v1 not found). Install cert-manager (and csi-driver for tls.agentIdentity=perPod), or set tls.provider=existingSecrets with tls.existingSecrets.{controller,agent} naming Secrets that hold tls.crt, tls.key and ca.crt with the SPIFFE URI SANs of docs/deploy.md, or set tls.enabled=false (no TLS: every caller that reaches a port is trusted). Helm cannot make these certificates itself: its genSignedCert writes no URI SAN." }}
{{- end }}
{{- else }}
{{- $t.provider }}
{{- end }}
{{- end }}

{{/* call with (dict "root" $ "role" "agent" ["pod" "${POD_UID}"]) */}}
{{- define "kvgrid.spiffeId" -}}
{{- $id := printf "spiffe://%s/ns/%s/role/%s" .root.Values.tls.trustDomain .root.Release.Namespace .role }}
{{- if .pod }}
{{- $id = printf "%s/pod/%s" $id .pod }}
{{- end }}
{{- $id }}
{{- end }}

{{/* Secret holding a role's certificate; call with (dict "root" $ "role" "controller"). */}}
{{- define "kvgrid.tlsSecretName" -}}
{{- if eq (include "kvgrid.tlsProvider" .root) "existingSecrets" }}
{{- get .root.Values.tls.existingSecrets .role }}
{{- else }}
{{- include "kvgrid.componentName" (dict "root" .root "suffix" (printf "%s-tls" .role)) }}
{{- end }}
{{- end }}

{{/* The issuer the role certificates come from (cert-manager). */}}
{{- define "kvgrid.issuerRef" -}}
{{- $ref := .Values.tls.certManager.issuerRef }}
{{- if $ref.name -}}
name: {{ $ref.name }}
kind: {{ $ref.kind }}
group: {{ $ref.group }}
{{- else -}}
name: {{ include "kvgrid.componentName" (dict "root" . "suffix" "ca") }}
kind: Issuer
group: cert-manager.io
{{- end }}
{{- end }}

{{/* KVGRID_TLS_* env for a kvgrid container (both services read these names). */}}
{{- define "kvgrid.tlsEnv" -}}
{{- if ne (include "kvgrid.tlsProvider" .) "off" -}}
- name: KVGRID_TLS_CERT_FILE
  value: /etc/kvgrid/tls/tls.crt
- name: KVGRID_TLS_KEY_FILE
  value: /etc/kvgrid/tls/tls.key
- name: KVGRID_TLS_CA_FILE
  value: /etc/kvgrid/tls/ca.crt
- name: KVGRID_TLS_TRUST_DOMAIN
  value: {{ .Values.tls.trustDomain | quote }}
{{- end }}
{{- end }}

{{/* The mount of a container's certificate; call with (dict "root" $ "volume" "kvgrid-tls"). */}}
{{- define "kvgrid.tlsVolumeMount" -}}
{{- if ne (include "kvgrid.tlsProvider" .root) "off" -}}
- name: {{ .volume }}
  mountPath: /etc/kvgrid/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* A volume with a role's certificate Secret; call with (dict "root" $ "role" "controller" "volume" "tls"). */}}
{{- define "kvgrid.tlsSecretVolume" -}}
- name: {{ .volume }}
  secret:
    secretName: {{ include "kvgrid.tlsSecretName" (dict "root" .root "role" .role) }}
    defaultMode: 0440
{{- end }}

{{/*
Certificate volumes of an engine pod's agent sidecars: one Secret volume shared by all (shared agent
identity) or one csi.cert-manager.io volume per sidecar whose URI SAN carries the pod UID (perPod;
sidecar i of several proves <pod uid>-gpu<i>, the POD_UID it registers with).
*/}}
{{- define "kvgrid.agentTlsVolumes" -}}
{{- if ne (include "kvgrid.tlsProvider" .) "off" }}
{{- if eq .Values.tls.agentIdentity "perPod" }}
{{- $root := . }}
{{- $ref := include "kvgrid.issuerRef" . | fromYaml }}
{{- range $i := until (int .Values.agent.sidecarsPerPod) }}
- name: {{ include "kvgrid.agentVolumeName" (dict "root" $root "i" $i "base" "kvgrid-tls") }}
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $ref.name | quote }}
      csi.cert-manager.io/issuer-kind: {{ $ref.kind | quote }}
      csi.cert-manager.io/issuer-group: {{ $ref.group | quote }}
      csi.cert-manager.io/uri-sans: {{ include "kvgrid.spiffeId" (dict "root" $root "role" "agent" "pod" (printf "${POD_UID}%s" (include "kvgrid.agentUidSuffix" (dict "root" $root "i" $i)))) | quote }}
      csi.cert-manager.io/common-name: "${POD_NAME}.${POD_NAMESPACE}"
      csi.cert-manager.io/dns-names: kvgrid-agent
      csi.cert-manager.io/key-usages: "server auth,client auth,digital signature,key encipherment"
      csi.cert-manager.io/duration: {{ $root.Values.tls.certManager.duration | quote }}
      csi.cert-manager.io/renew-before: {{ $root.Values.tls.certManager.renewBefore | quote }}
      csi.cert-manager.io/fs-group: {{ $root.Values.tls.fsGroup | quote }}
      csi.cert-manager.io/certificate-file: tls.crt
      csi.cert-manager.io/privatekey-file: tls.key
      csi.cert-manager.io/ca-file: ca.crt
{{- end }}
{{- else }}
{{ include "kvgrid.tlsSecretVolume" (dict "root" . "role" "agent" "volume" "kvgrid-tls") }}
{{- end }}
{{- end }}
{{- end }}
