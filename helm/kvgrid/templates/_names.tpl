{{/*
Object names. Every name this chart makes is <fullname>-<suffix>; the fullname part is cut first so
the whole name stays a valid DNS label (<= 63 characters) and the suffix stays readable even for a
53-character release name.
*/}}

{{/* call with (dict "root" $ "suffix" "controller") */}}
{{- define "kvgrid.componentName" -}}
{{- $max := sub 62 (len .suffix) | int }}
{{- printf "%s-%s" (include "kvgrid.fullname" .root | trunc $max | trimSuffix "-") .suffix }}
{{- end }}
