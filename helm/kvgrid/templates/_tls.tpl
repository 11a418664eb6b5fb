{{/*
TLS: where the certificates come from and how pods get them.

Identities are SPIFFE IDs in the certificates' URI SAN (cert-manager, existingSecrets):
  spiffe://<tls.trustDomain>/ns/<release namespace>/role/{controller,router,agent}
  spiffe://<tls.trustDomain>/ns/<release namespace>/role/agent/pod/<pod uid>   (tls.agentIdentity=perPod)
or, for certificates the chart makes itself (tls.provider=helm; Helm's genSignedCert writes every
alt name as a DNS SAN and no URI SAN), a DNS SAN (kvgrid.common.authz reads both):
  {controller,router,agent}.<release namespace>.kvgrid-id.<tls.trustDomain>
Every certificate is mounted at /etc/kvgrid/tls/{tls.crt,tls.key,ca.crt} (cert-manager's Secret
layout) and named to the services through KVGRID_TLS_* env. Rotation replaces the mounted files in
place and the services reload them, so nothing here restarts pods for a new certificate.
*/}}

{{/* "cert-manager" | "helm" | "existingSecrets" | "off" */}}
{{- define "kvgrid.tlsProvider" -}}
{{- $t := .Values.tls }}
{{- if not $t.enabled }}
{{- "off" }}
{{- else if eq $t.provider "auto" }}
{{- include "kvgrid.tlsAutoProvider" . }}
{{- else }}
{{- $t.provider }}
{{- end }}
{{- end }}

{{/*
The certificate source tls.provider=auto uses: sticky. An install picks cert-manager when the
cluster serves cert-manager.io/v1, else helm, and records the pick in the ConfigMap
<fullname>-tls-source (templates/tls-source.yaml). Every later upgrade keeps the recorded source,
even after cert-manager's CRDs appear (or go): switching would delete the chart's CA and role
Secrets and point the pods at Secrets cert-manager has not written yet. Only an explicit
tls.provider changes the source (and the record follows it). A release installed before the record
existed is read from its Secrets: cert-manager's carry the cert-manager.io/certificate-name
annotation, the chart's own are labelled managed-by Helm.

Without a cluster (helm template, --dry-run=client) lookup finds nothing: the install pick. The
lookups run once per render (the answer is kept in the root context under kvgridTlsAutoProvider).
*/}}
{{- define "kvgrid.tlsAutoProvider" -}}
{{- if not (hasKey . "kvgridTlsAutoProvider") }}
{{- $ns := .Release.Namespace }}
{{- $found := dict
  "recorded" (lookup "v1" "ConfigMap" $ns (include "kvgrid.tlsSourceName" .))
  "router" (lookup "v1" "Secret" $ns (include "kvgrid.componentName" (dict "root" . "suffix" "router-tls")))
  "ca" (lookup "v1" "Secret" $ns (include "kvgrid.componentName" (dict "root" . "suffix" "ca")))
  "certManager" (.Capabilities.APIVersions.Has "cert-manager.io/v1")
  "record" (include "kvgrid.tlsSourceName" .) }}
{{- $_ := set . "kvgridTlsAutoProvider" (include "kvgrid.tlsAutoChoice" $found) }}
{{- end }}
{{- get . "kvgridTlsAutoProvider" }}
{{- end }}

{{/*
The decision of kvgrid.tlsAutoProvider from what lookup found (kept apart so tests can feed it):
(dict "recorded" <ConfigMap or {}> "router" <router Secret or {}> "ca" <CA Secret or {}>
"certManager" <the cluster serves cert-manager.io/v1> "record" <the ConfigMap's name>).
A release on cert-manager whose cluster lost cert-manager.io/v1 fails rather than switch.
*/}}
{{- define "kvgrid.tlsAutoChoice" -}}
{{- $recorded := dig "data" "provider" "" .recorded }}
{{- if and (eq $recorded "cert-manager") (not .certManager) }}
{{- fail (printf "tls.provider=auto: this release gets its certificates from cert-manager (ConfigMap %s records it), but the cluster does not serve cert-manager.io/v1. auto never switches the source on its own: install cert-manager's CRDs again, or set tls.provider=helm to move to the chart's own CA (a new CA and new certificates)" .record) }}
{{- else if has $recorded (list "cert-manager" "helm") }}
{{- $recorded }}
{{- else }}
{{- $legacy := "" }}
{{- range $s := list .router .ca }}
{{- if and $s (not $legacy) }}
{{- if hasKey (dig "metadata" "annotations" (dict) $s) "cert-manager.io/certificate-name" }}
{{- $legacy = "cert-manager" }}
{{- else if eq (dig "metadata" "labels" "app.kubernetes.io/managed-by" "" $s) "Helm" }}
{{- $legacy = "helm" }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq $legacy "cert-manager") (not .certManager) }}
{{- fail (printf "tls.provider=auto: this release gets its certificates from cert-manager (its Secrets say so), but the cluster does not serve cert-manager.io/v1. auto never switches the source on its own: install cert-manager's CRDs again, or set tls.provider=helm to move to the chart's own CA (a new CA and new certificates)") }}
{{- else if $legacy }}
{{- $legacy }}
{{- else if .certManager }}
{{- "cert-manager" }}
{{- else }}
{{- "helm" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgrid.tlsSourceName" -}}
{{- include "kvgrid.componentName" (dict "root" . "suffix" "tls-source") }}
{{- end }}

{{/*
"true" when agents prove their pod by a ServiceAccount token (tls.agentIdentity=podToken with TLS on):
the sidecars mount it and the controller verifies it (TokenReview). Without TLS nothing is verified.
*/}}
{{- define "kvgrid.podTokens" -}}
{{- if and (ne (include "kvgrid.tlsProvider" .) "off") (eq .Values.tls.agentIdentity "podToken") }}true{{ end }}
{{- end }}

{{/* The controller's --agent-pod-proof for tls.agentIdentity. */}}
{{- define "kvgrid.agentPodProof" -}}
{{- get (dict "podToken" "token" "perPod" "certificate" "sharedCertificateUnverified" "unverified" "shared" "unverified") .Values.tls.agentIdentity }}
{{- end }}

{{- define "kvgrid.podTokenDir" -}}/var/run/secrets/kvgrid{{- end }}

{{/* The mount of the pod token volume in an agent sidecar (podToken mode). */}}
{{- define "kvgrid.podTokenMount" -}}
{{- if include "kvgrid.podTokens" . -}}
- name: kvgrid-pod-token
  mountPath: {{ include "kvgrid.podTokenDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The agent sidecar's env naming the token file (podToken mode). */}}
{{- define "kvgrid.podTokenEnv" -}}
{{- if include "kvgrid.podTokens" . -}}
- name: KVGRID_CONTROLLER_TOKEN_FILE
  value: {{ printf "%s/token" (include "kvgrid.podTokenDir" .) | quote }}
{{- end }}
{{- end }}

{{/* The DNS SAN identity of a role (tls.provider=helm); call with (dict "root" $ "role" "agent"). */}}
{{- define "kvgrid.dnsId" -}}
{{- printf "%s.%s.kvgrid-id.%s" .role .root.Release.Namespace .root.Values.tls.trustDomain }}
{{- end }}

{{/*
The role certificates a provider issues, as JSON (fromJsonArray): role, usages and the DNS names
the services verify (kvgrid.common.tls: kvgrid-controller and kvgrid-agent, whatever address they
dial) plus the controller's Service names. No shared agent certificate with tls.agentIdentity=perPod.
*/}}
{{- define "kvgrid.tlsRoles" -}}
{{- $ctrl := include "kvgrid.controllerName" . }}
{{- $headless := include "kvgrid.componentName" (dict "root" . "suffix" "controllers") }}
{{- $ns := .Release.Namespace }}
{{- $roles := list }}
{{- if .Values.controller.enabled }}
{{- $roles = append $roles (dict "role" "controller" "usages" (list "server auth" "client auth") "dns" (list "kvgrid-controller" $ctrl (printf "%s.%s" $ctrl $ns) (printf "%s.%s.svc" $ctrl $ns) (printf "%s.%s.svc.cluster.local" $ctrl $ns) (printf "%s.%s.svc" $headless $ns))) }}
{{- end }}
{{- $roles = append $roles (dict "role" "router" "usages" (list "client auth") "dns" (list)) }}
{{- if ne .Values.tls.agentIdentity "perPod" }}
{{- $roles = append $roles (dict "role" "agent" "usages" (list "server auth" "client auth") "dns" (list "kvgrid-agent")) }}
{{- end }}
{{- toJson $roles }}
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
certificate) or one csi.cert-manager.io volume per sidecar whose URI SAN carries the pod UID (perPod;
sidecar i of several proves <pod uid>-gpu<i>, the POD_UID it registers with); with podToken also the
projected volume of the pod's ServiceAccount token (audience tls.podToken.audience), which every
sidecar of the pod sends to the controller.
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
{{- if include "kvgrid.podTokens" . }}
{{- /* The pod's own ServiceAccount token for the controller (podToken): the kubelet writes a new one
before the old expires; group-readable by tls.fsGroup, like the certificate Secret. */}}
- name: kvgrid-pod-token
  projected:
    defaultMode: 0440
    sources:
      - serviceAccountToken:
          audience: {{ .Values.tls.podToken.audience | quote }}
          expirationSeconds: {{ .Values.tls.podToken.expirationSeconds | int }}
          path: token
{{- end }}
{{- end }}
{{- end }}
