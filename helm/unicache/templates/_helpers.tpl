{{/*
Names and labels. Every name is truncated to 63 characters (the DNS label limit) with
any trailing "-" removed, so long release names still render valid resources.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "unicache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified app name: fullnameOverride, else <release>-<chart> (just <release>
when the release name already contains the chart name).
*/}}
{{- define "unicache.fullname" -}}
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

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "unicache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "unicache.labels" -}}
helm.sh/chart: {{ include "unicache.chart" . }}
{{ include "unicache.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: unicache
{{- end }}

{{/* Selector labels (immutable on Deployments/StatefulSets: never add to these). */}}
{{- define "unicache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "unicache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Per-component helpers. Call with (dict "ctx" $ "component" "router").
*/}}
{{- define "unicache.componentName" -}}
{{- $full := include "unicache.fullname" .ctx | trunc (int (sub 62 (len .component))) | trimSuffix "-" }}
{{- printf "%s-%s" $full .component }}
{{- end }}

{{- define "unicache.componentLabels" -}}
{{ include "unicache.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "unicache.componentSelectorLabels" -}}
{{ include "unicache.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: the digest wins when set. */}}
{{/*
An image reference: `repository@digest` when a digest is given, else `repository:tag`;
an empty tag falls back to `defaultTag` (the chart's appVersion for the images this
project builds, so chart and images are released together), and fails when there is none.
Call as (dict "image" .Values.x.image "defaultTag" .Chart.AppVersion).
*/}}
{{- define "unicache.image" -}}
{{- $img := .image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- $tag := toString ($img.tag | default .defaultTag) }}
{{- if not $tag }}{{ fail (printf "image %s needs a tag or a digest" $img.repository) }}{{ end }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret holding API keys, the salt secret and the in-cluster Redis password. */}}
{{- define "unicache.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- include "unicache.componentName" (dict "ctx" . "component" "secrets") }}
{{- end }}
{{- end }}

{{/*
Transport security (docs/security.md): mutual TLS between router and replicas and TLS to the
in-cluster Redis are on unless `insecureNoTls` (the named opt-out) is set. "true" or "".
`replicaTls.enabled: false` without the opt-out fails the render rather than run insecure.
*/}}
{{- define "unicache.replicaTlsOn" -}}
{{- if not .Values.insecureNoTls }}
{{- if not .Values.replicaTls.enabled }}
{{- fail "replicaTls.enabled is false: mutual TLS between router and replicas is the default; to run without it set insecureNoTls: true (what that gives up: values.yaml, docs/security.md)" }}
{{- end }}true
{{- end }}
{{- end }}

{{- define "unicache.redisTlsOn" -}}
{{- if and (include "unicache.redisDeployed" .) (not .Values.insecureNoTls) }}true{{ end }}
{{- end }}

{{/* "true" when the chart issues certificates itself (secret-tls.yaml). */}}
{{- define "unicache.tlsGenerated" -}}
{{- if or (and (include "unicache.replicaTlsOn" .) (eq .Values.replicaTls.source "generated")) (include "unicache.redisTlsOn" .) }}true{{ end }}
{{- end }}

{{- define "unicache.generatedTlsSecretName" -}}
{{- include "unicache.componentName" (dict "ctx" . "component" "tls") }}
{{- end }}

{{/* UNICACHE_INSECURE_NO_TLS for the router and the launcher (the replica actors) under the opt-out. */}}
{{- define "unicache.insecureEnv" -}}
{{- if .Values.insecureNoTls }}
- name: UNICACHE_INSECURE_NO_TLS
  value: "true"
{{- end }}
{{- end }}

{{/* The in-cluster Redis's CA (the chart's cluster CA), for Redis clients: router, launcher, replica actors. */}}
{{- define "unicache.redisTlsVolume" -}}
- name: redis-tls
  secret:
    secretName: {{ include "unicache.generatedTlsSecretName" . }}
    defaultMode: 0444
    items:
      - key: ca.crt
        path: ca.pem
{{- end }}

{{- define "unicache.redisTlsMount" -}}
- name: redis-tls
  mountPath: /etc/unicache/redis-tls
  readOnly: true
{{- end }}

{{/* The Redis URL (without password) every component uses. */}}
{{- define "unicache.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s://%s.%s.svc:6379/0" (ternary "rediss" "redis" (eq (include "unicache.redisTlsOn" .) "true")) (include "unicache.componentName" (dict "ctx" . "component" "redis")) .Release.Namespace }}
{{- else }}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/*
Env vars UNICACHE_REDIS_PASSWORD (from a Secret; omitted for a password-less external
Redis) and UNICACHE_REDIS_URL with that password embedded through Kubernetes' $(VAR)
expansion: the replicas take their Redis credentials from the URL only.
*/}}
{{- define "unicache.redisEnv" -}}
{{- $url := include "unicache.redisUrl" . }}
{{- if .Values.redis.enabled }}
- name: UNICACHE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "unicache.componentName" (dict "ctx" . "component" "redis") }}
      key: redis-password
{{- $url = regexReplaceAll "^(rediss?://)" $url "${1}:$(UNICACHE_REDIS_PASSWORD)@" }}
{{- else if .Values.redis.external.passwordSecret }}
- name: UNICACHE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.passwordSecret }}
      key: {{ .Values.redis.external.passwordSecretKey }}
{{- $url = regexReplaceAll "^(rediss?://)" $url "${1}:$(UNICACHE_REDIS_PASSWORD)@" }}
{{- end }}
- name: UNICACHE_REDIS_URL
  value: {{ $url | quote }}
{{- if include "unicache.redisTlsOn" . }}
- name: UNICACHE_REDIS_TLS_CA
  value: /etc/unicache/redis-tls/ca.pem
{{- end }}
{{- end }}

{{/* The cluster key (router and launcher; the launcher ships it to the replica actors). */}}
{{- define "unicache.clusterKeyEnv" -}}
- name: UNICACHE_CLUSTER_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "unicache.secretName" . }}
      key: cluster-key
{{- end }}

{{/* The KubeRay RayCluster name and the head Service KubeRay creates for it. */}}
{{- define "unicache.rayClusterName" -}}
{{- include "unicache.componentName" (dict "ctx" . "component" "ray") | trunc 48 | trimSuffix "-" }}
{{- end }}

{{- define "unicache.rayHeadService" -}}
{{- printf "%s-head-svc" (include "unicache.rayClusterName" .) }}
{{- end }}

{{/* Number of replica actors the launcher starts. */}}
{{- define "unicache.replicaCount" -}}
{{- if gt (int .Values.replicas.count) 0 }}
{{- .Values.replicas.count }}
{{- else }}
{{- $gpus := mul (int .Values.rayCluster.worker.replicas) (max 1 (int .Values.rayCluster.worker.gpusPerWorker)) }}
{{- max 1 (div $gpus (include "unicache.gpusPerReplica" . | int)) }}
{{- end }}
{{- end }}

{{/* GPUs one replica actor requests: the vllm engine's tensor-parallel size, else one. */}}
{{- define "unicache.gpusPerReplica" -}}
{{- if eq .Values.replicas.engine "vllm" }}{{ max 1 (int .Values.replicas.vllm.tensorParallelSize) }}{{ else }}1{{ end }}
{{- end }}

{{/* The model name served: replicas.servedModelName, else the checkpoint directory's name
(as unicache/contract/model_name.py names it for the replicas), else settings.modelName. */}}
{{- define "unicache.servedModelName" -}}
{{- $checkpoint := include "unicache.checkpointPath" . }}
{{- if .Values.replicas.servedModelName }}{{ .Values.replicas.servedModelName }}
{{- else if $checkpoint }}{{ base (trimSuffix "/" $checkpoint) }}
{{- else }}{{ .Values.settings.modelName }}{{ end }}
{{- end }}

{{/* Pod security context shared by every pod: non-root, fixed high UID, RuntimeDefault seccomp. */}}
{{- define "unicache.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container security context: no privilege escalation, all capabilities dropped, read-only root. */}}
{{- define "unicache.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Model weights (values `model`): the checkpoint directory the replicas (and the router,
for the tokenizer) read, and the volume, mount and init container that provide it.
`replicas.checkpoint` wins when set; else `model.mountPath` (+ `model.subPath`) when a
source is configured; else none (the seeded random model).
*/}}
{{- define "unicache.checkpointPath" -}}
{{- if .Values.replicas.checkpoint }}
{{- .Values.replicas.checkpoint }}
{{- else if ne .Values.model.source "none" }}
{{- if .Values.model.subPath }}{{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.subPath }}{{ else }}{{ .Values.model.mountPath }}{{ end }}
{{- end }}
{{- end }}

{{- define "unicache.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName | quote }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path | quote }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.initContainer.sizeLimit | quote }}
{{- end }}
{{- end }}

{{- define "unicache.modelMount" -}}
{{- if ne .Values.model.source "none" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "unicache.modelInitContainer" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "initContainer" }}
- name: fetch-model
  image: {{ include "unicache.image" (dict "image" $m.initContainer.image "defaultTag" "") | quote }}
  imagePullPolicy: {{ $m.initContainer.image.pullPolicy }}
  command:
    {{- toYaml (required "model.initContainer.command is required when model.source is initContainer" $m.initContainer.command) | nindent 4 }}
  env:
    - name: MODEL_DIR
      value: {{ $m.mountPath | quote }}
    {{- with $m.initContainer.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml $m.initContainer.resources | nindent 4 }}
  securityContext:
    {{- include "unicache.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/*
Replica metrics ports per worker pod: one per replica actor the pod hosts (one per GPU, at least one).
*/}}
{{- define "unicache.metricsPortSpan" -}}
{{- max 1 (int .Values.rayCluster.worker.gpusPerWorker) -}}
{{- end }}

{{/*
The router's --shared-sessions: `auto` becomes `on` when the chart runs more than one router
process (several pods, an HPA, or several workers per pod), which a pod cannot see from inside.
*/}}
{{- define "unicache.sharedSessions" -}}
{{- $r := .Values.router -}}
{{- if and (eq (toString $r.sharedSessions) "auto") (or (gt (int $r.replicaCount) 1) $r.autoscaling.enabled (gt (int $r.workers) 1)) -}}
on
{{- else -}}
{{- $r.sharedSessions -}}
{{- end -}}
{{- end }}

{{/* Replica ids the launcher gives its actors (UNICACHE_ID_PREFIX + "-<i>"). */}}
{{- define "unicache.replicaIds" -}}
{{- $ids := list }}
{{- range $i := until (include "unicache.replicaCount" . | int) }}
{{- $id := printf "%s-replica-%d" $.Release.Name $i }}
{{- if gt (len $id) 63 }}
{{- fail (printf "replicaTls: replica id %q is longer than a DNS label (63): shorten the release name" $id) }}
{{- end }}
{{- $ids = append $ids $id }}
{{- end }}
{{- join "," $ids }}
{{- end }}

{{/* The Secret cert-manager fills for one certificate ("router" or a replica id). */}}
{{- define "unicache.tlsSecretName" -}}
{{- printf "%s-tls-%s" (include "unicache.fullname" .ctx | trunc 40 | trimSuffix "-") (.name | sha256sum | trunc 8) }}
{{- end }}

{{/*
The replicaTls volume of the router ("router") or of the replicas' worker pods
("replicas"): a projected volume with ca.pem and, per identity, <name>.pem and
<name>-key.pem (the file names unicache/plumbing/tls.py's settings use). Mounted whole (never
subPath), so renewed Secrets reach the files and the processes pick them up.
*/}}
{{- define "unicache.replicaTlsVolume" -}}
{{- $ctx := .ctx }}
{{- $t := $ctx.Values.replicaTls }}
{{- $names := ternary (list "router") (splitList "," (include "unicache.replicaIds" $ctx)) (eq .component "router") }}
- name: replica-tls
  projected:
    defaultMode: 0400
    sources:
      {{- if eq $t.source "generated" }}
      {{- /* Two CAs: the cluster CA signs servers (replicas, Redis) and the router trusts it;
      the router CA signs only the router's client certificate and the replicas trust only
      it, so no replica's certificate can call a replica (Helm's genSignedCert cannot limit
      extended key usage). */}}
      - secret:
          name: {{ include "unicache.generatedTlsSecretName" $ctx }}
          items:
            - key: {{ ternary "ca.crt" "router-ca.crt" (eq .component "router") }}
              path: ca.pem
            {{- range $names }}
            - key: {{ . }}.crt
              path: {{ . }}.pem
            - key: {{ . }}.key
              path: {{ . }}-key.pem
            {{- end }}
      {{- else if eq $t.source "secret" }}
      - secret:
          name: {{ required "replicaTls.existingSecret is required when replicaTls.source is secret" $t.existingSecret }}
          items:
            - key: ca.crt
              path: ca.pem
            {{- range $names }}
            - key: {{ . }}.crt
              path: {{ . }}.pem
            - key: {{ . }}.key
              path: {{ . }}-key.pem
            {{- end }}
      {{- else }}
      {{- range $i, $name := $names }}
      - secret:
          name: {{ include "unicache.tlsSecretName" (dict "ctx" $ctx "name" $name) }}
          items:
            {{- if eq $i 0 }}
            - key: ca.crt
              path: ca.pem
            {{- end }}
            - key: tls.crt
              path: {{ $name }}.pem
            - key: tls.key
              path: {{ $name }}-key.pem
      {{- end }}
      {{- end }}
{{- end }}

{{- define "unicache.replicaTlsMount" -}}
- name: replica-tls
  mountPath: /etc/unicache/tls
  readOnly: true
{{- end }}
