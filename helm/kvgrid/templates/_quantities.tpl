{{/*
Byte sizes and Kubernetes quantities. The services read sizes such as 8GiB (kvgrid's byte-size
syntax); Kubernetes wants quantities such as 8Gi. Both spellings are accepted in values and
converted here, so a value that renders is always valid for its reader.
*/}}

{{/* "8GiB" | "8Gi" | "8G" | "512Mi" | 1024 -> "8Gi" | "8G" | "512Mi" | "1024": a Kubernetes quantity. */}}
{{- define "kvgrid.quantity" -}}
{{- /* YAML numbers reach templates as float64: print whole numbers as integers, not 1.07e+09 */}}
{{- $s := ternary (int64 . | toString) (toString .) (kindIs "float64" .) }}
{{- $m := regexFindAll "^([0-9]+(?:\\.[0-9]+)?)([kKMGTPE]?)(i?)B?$" $s 1 }}
{{- if not $m }}
{{- fail (printf "%q is not a size: expected a number with an optional unit such as 8GiB, 8Gi, 512Mi or 64G" $s) }}
{{- end }}
{{- $num := regexReplaceAll "^([0-9.]+).*$" $s "${1}" }}
{{- $unit := regexReplaceAll "^[0-9.]+([kKMGTPE]?)(i?)B?$" $s "${1}" }}
{{- $iec := regexReplaceAll "^[0-9.]+([kKMGTPE]?)(i?)B?$" $s "${2}" }}
{{- if and $iec (not $unit) }}
{{- fail (printf "%q is not a size: 'i' needs a unit letter (Ki, Mi, Gi, ...)" $s) }}
{{- end }}
{{- if $iec }}
{{- printf "%s%si" $num (upper $unit) }}
{{- else if eq $unit "K" }}
{{- printf "%sk" $num }}
{{- else }}
{{- printf "%s%s" $num $unit }}
{{- end }}
{{- end }}

{{/* A size (either spelling) -> its number of bytes, as an integer string. */}}
{{- define "kvgrid.bytes" -}}
{{- $q := include "kvgrid.quantity" . }}
{{- $num := regexReplaceAll "^([0-9.]+).*$" $q "${1}" | float64 }}
{{- $unit := regexReplaceAll "^[0-9.]+" $q "" }}
{{- $scale := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- mulf $num (get $scale $unit) | floor | int64 }}
{{- end }}
