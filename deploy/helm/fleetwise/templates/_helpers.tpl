{{/* Names */}}
{{- define "fleetwise.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetwise.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels: pass (dict "ctx" $ "component" "worker") */}}
{{- define "fleetwise.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetwise.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fleetwise.labels" -}}
{{ include "fleetwise.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: fleetwise
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "fleetwise.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "fleetwise.signingSecret" -}}
{{- default (printf "%s-signing" (include "fleetwise.fullname" .)) .Values.signing.secretName -}}
{{- end -}}

{{- define "fleetwise.saslSecret" -}}
{{- default (printf "%s-kafka-sasl" (include "fleetwise.fullname" .)) .Values.kafka.sasl.secretName -}}
{{- end -}}

{{- define "fleetwise.sasl" -}}
{{- if hasPrefix "SASL_" (upper .Values.kafka.security) -}}true{{- end -}}
{{- end -}}

{{- define "fleetwise.tls" -}}
{{- if hasSuffix "SSL" (upper .Values.kafka.security) -}}true{{- end -}}
{{- end -}}

{{/* Validation of values that would otherwise fail at run time. */}}
{{- define "fleetwise.validate" -}}
{{- $protocols := list "PLAINTEXT" "SSL" "SASL_SSL" "SASL_PLAINTEXT" -}}
{{- if not (has (upper .Values.kafka.security) $protocols) -}}
{{- fail (printf "kafka.security must be one of %s, got %q" (join ", " $protocols) .Values.kafka.security) -}}
{{- end -}}
{{- if not (has .Values.agent.source (list "nvml" "dcgm")) -}}
{{- fail (printf "agent.source must be nvml or dcgm, got %q" .Values.agent.source) -}}
{{- end -}}
{{- $gpu := dict -}}
{{- range .Values.kafka.topics -}}
{{- if eq .name "fleetwise.telemetry.gpu" -}}{{- $_ := set $gpu "partitions" (int .partitions) -}}{{- end -}}
{{- end -}}
{{- if not (hasKey $gpu "partitions") -}}
{{- fail "kafka.topics must list fleetwise.telemetry.gpu (the workers' input topic)" -}}
{{- end -}}
{{- if and .Values.worker.enabled (gt (int .Values.worker.replicas) (int $gpu.partitions)) -}}
{{- fail (printf "worker.replicas (%d) must be <= the partitions of fleetwise.telemetry.gpu (%d): a worker without a partition sits idle" (int .Values.worker.replicas) (int $gpu.partitions)) -}}
{{- end -}}
{{- if lt (int .Values.worker.replicas) 1 -}}
{{- fail (printf "worker.replicas must be at least 1, got %d" (int .Values.worker.replicas)) -}}
{{- end -}}
{{- if and .Values.consumer.enabled (ne (int .Values.consumer.replicas) 1) -}}
{{- fail (printf "consumer.replicas must be 1, got %d: one consumer decides the drains one at a time (the fleet drain cap on the cluster)" (int .Values.consumer.replicas)) -}}
{{- end -}}
{{- end -}}

{{/* Env and mounts every Kafka client shares: bootstrap, security, signing keys. */}}
{{- define "fleetwise.kafkaEnv" -}}
- name: FLEETWISE_KAFKA_SECURITY
  value: {{ upper .Values.kafka.security | quote }}
{{- if include "fleetwise.sasl" . }}
- name: FLEETWISE_KAFKA_SASL_MECHANISM
  value: {{ .Values.kafka.sasl.mechanism | quote }}
- name: FLEETWISE_KAFKA_USER_FILE
  value: /etc/fleetwise/kafka-sasl/username
- name: FLEETWISE_KAFKA_PASSWORD_FILE
  value: /etc/fleetwise/kafka-sasl/password
{{- end }}
{{- if and (include "fleetwise.tls" .) .Values.kafka.tls.caSecret }}
- name: FLEETWISE_KAFKA_CA_FILE
  value: /etc/fleetwise/kafka-ca/{{ .Values.kafka.tls.caKey }}
{{- end }}
{{- end -}}

{{- define "fleetwise.kafkaMounts" -}}
{{- if include "fleetwise.sasl" . }}
- name: kafka-sasl
  mountPath: /etc/fleetwise/kafka-sasl
  readOnly: true
{{- end }}
{{- if and (include "fleetwise.tls" .) .Values.kafka.tls.caSecret }}
- name: kafka-ca
  mountPath: /etc/fleetwise/kafka-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "fleetwise.kafkaVolumes" -}}
{{- if include "fleetwise.sasl" . }}
- name: kafka-sasl
  secret:
    secretName: {{ include "fleetwise.saslSecret" . }}
    defaultMode: 0440
    items:
      - {key: username, path: username}
      - {key: password, path: password}
{{- end }}
{{- if and (include "fleetwise.tls" .) .Values.kafka.tls.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.tls.caSecret }}
    items:
      - {key: {{ .Values.kafka.tls.caKey }}, path: {{ .Values.kafka.tls.caKey }}}
{{- end }}
{{- end -}}

{{- /* The operators' keys are in the signing Secret (item operator-keys) when given inline or
declared to be in the user's Secret; otherwise the development operator key verifies. */ -}}
{{- define "fleetwise.operatorKeys" -}}
{{- if or .Values.signing.operatorKeys .Values.signing.operatorKeysInSecret -}}true{{- end -}}
{{- end -}}

{{- define "fleetwise.signingEnv" -}}
- name: FLEETWISE_SIGNING_KEYS_FILE
  value: /etc/fleetwise/signing/keys
{{- if include "fleetwise.operatorKeys" . }}
- name: FLEETWISE_OPERATOR_KEYS_FILE
  value: /etc/fleetwise/signing/operator-keys
{{- end }}
{{- end -}}

{{- define "fleetwise.signingMount" -}}
- name: signing-keys
  mountPath: /etc/fleetwise/signing
  readOnly: true
{{- end -}}

{{- /* ctx: the root; verifier: the kube consumer, which reads the verify-keys item (public
Ed25519 keys) in the place of keys when there is one, so it holds no key that signs. */ -}}
{{- define "fleetwise.signingVolume" -}}
{{- $v := .ctx.Values.signing -}}
- name: signing-keys
  secret:
    secretName: {{ include "fleetwise.signingSecret" .ctx }}
    defaultMode: 0440
    items:
      {{- if and .verifier (or $v.verifyKeys $v.verifyKeysInSecret) }}
      - {key: verify-keys, path: keys}
      {{- else }}
      - {key: keys, path: keys}
      {{- end }}
      {{- if include "fleetwise.operatorKeys" .ctx }}
      - {key: operator-keys, path: operator-keys}
      {{- end }}
{{- end -}}

{{/* The topic prefix argument, when set. */}}
{{- define "fleetwise.prefixArgs" -}}
{{- if .Values.kafka.topicPrefix }}
- --topic-prefix
- {{ .Values.kafka.topicPrefix | quote }}
{{- end }}
{{- end -}}

{{/* The namespace the consumer acts in (its --namespace). */}}
{{- define "fleetwise.jobNamespace" -}}
{{- default .Release.Namespace .Values.consumer.jobNamespace -}}
{{- end -}}

{{- /* A site's catalog rows (`catalog.extraRows`), for the components that resolve GPU models. */ -}}
{{- define "fleetwise.catalogEnv" -}}
{{- if .Values.catalog.extraRows }}
- name: FLEETWISE_CATALOG_EXTRA
  value: /etc/fleetwise/catalog/gpus.csv
{{- end }}
{{- end -}}

{{- define "fleetwise.catalogMount" -}}
{{- if .Values.catalog.extraRows }}
- {name: catalog, mountPath: /etc/fleetwise/catalog, readOnly: true}
{{- end }}
{{- end -}}

{{- define "fleetwise.catalogVolume" -}}
{{- if .Values.catalog.extraRows }}
- name: catalog
  configMap:
    name: {{ include "fleetwise.fullname" . }}-catalog
{{- end }}
{{- end -}}
