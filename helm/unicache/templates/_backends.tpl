{{/*
Backends (values `backends`): which fleet the routers route to. `ray` is the RayCluster of
UniCache replicas (launcher, Redis-announced); `vllm` is a StatefulSet of stock `vllm serve`
pods this chart runs; `external` is a vLLM fleet the user already runs. The router reaches
vLLM backends by the `backends` setting (UNICACHE_BACKENDS: `;`-separated
`URL,kv-events=tcp://HOST:PORT,replay=tcp://HOST:PORT,id=NAME` entries,
router/upstream/vllm_fleet/spec.py) and indexes their own KV events, so it needs no Redis for them.
*/}}

{{/* "true" when the chart runs the RayCluster, the launcher and their policies. */}}
{{- define "unicache.rayMode" -}}
{{- if eq .Values.backends.mode "ray" }}true{{ end }}
{{- end }}

{{/*
"true" when the routers use Redis: always for `ray` (replicas announce themselves there);
for vLLM backends only to share explicit sessions' placement (and the policy's terms)
between router processes, i.e. when `router.sharedSessions` resolves to on.
*/}}
{{- define "unicache.usesRedis" -}}
{{- if eq .Values.backends.mode "ray" }}true
{{- else if has (include "unicache.sharedSessions" .) (list "on" "true") }}true
{{- end }}
{{- end }}

{{/* "true" when the chart runs its own Redis StatefulSet. */}}
{{- define "unicache.redisDeployed" -}}
{{- if and .Values.redis.enabled (include "unicache.usesRedis" .) }}true{{ end }}
{{- end }}

{{/* The vLLM StatefulSet and its headless Service (stable pod names <sts>-<i>.<svc>). */}}
{{- define "unicache.vllmName" -}}
{{- include "unicache.componentName" (dict "ctx" . "component" "vllm") }}
{{- end }}

{{- define "unicache.vllmHeadlessService" -}}
{{- include "unicache.componentName" (dict "ctx" . "component" "vllm-headless") }}
{{- end }}

{{/*
The router's `backends` setting. `vllm`: one entry per StatefulSet pod by its stable DNS
name (<sts>-<i>.<headless-svc>.<ns>.svc.cluster.local), so the router needs no discovery;
`external`: the listed URLs with their events addresses. Empty otherwise.
*/}}
{{- define "unicache.backendList" -}}
{{- $entries := list }}
{{- if eq .Values.backends.mode "vllm" }}
{{- $v := .Values.backends.vllm }}
{{- $sts := include "unicache.vllmName" . }}
{{- $svc := include "unicache.vllmHeadlessService" . }}
{{- range $i := until (int $v.replicas) }}
{{- $host := printf "%s-%d.%s.%s.svc.cluster.local" $sts $i $svc $.Release.Namespace }}
{{- if $v.publishToRouter }}
{{- /* the pod publishes to the router on the topic <sts>-<i>: its id */}}
{{- $entries = append $entries (printf "http://%s:%d,replay=tcp://%s:%d,id=%s-%d" $host (int $v.port) $host (int $v.replayPort) $sts $i) }}
{{- else }}
{{- $entries = append $entries (printf "http://%s:%d,kv-events=tcp://%s:%d,replay=tcp://%s:%d,id=%s-%d" $host (int $v.port) $host (int $v.kvEventsPort) $host (int $v.replayPort) $sts $i) }}
{{- end }}
{{- end }}
{{- else if eq .Values.backends.mode "external" }}
{{- range .Values.backends.external.urls }}
{{- $e := list (trimSuffix "/" .url) }}
{{- with .kvEvents }}{{ $e = append $e (printf "kv-events=%s" .) }}{{ end }}
{{- with .replay }}{{ $e = append $e (printf "replay=%s" .) }}{{ end }}
{{- with .id }}{{ $e = append $e (printf "id=%s" .) }}{{ end }}
{{- $entries = append $entries (join "," $e) }}
{{- end }}
{{- end }}
{{- join ";" $entries }}
{{- end }}

{{/*
The external fleet's label selector as a Kubernetes selector string (`k=v,k2=v2`), empty
without one: the router watches the EndpointSlices it picks (`unicache.backendDiscovery`).
*/}}
{{- define "unicache.backendSelector" -}}
{{- if eq .Values.backends.mode "external" }}
{{- $pairs := list }}
{{- range $k, $v := .Values.backends.external.selector }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}
{{- end }}

{{/*
The router's `backend_discovery` for an external fleet: `k8s://NAMESPACE?selector=...&port=...`
with a selector (router/upstream/vllm_fleet/k8s_discovery.py), else
`backends.external.dnsDiscovery`; empty otherwise. Both at once fail the render.
*/}}
{{- define "unicache.backendDiscovery" -}}
{{- if eq .Values.backends.mode "external" }}
{{- $e := .Values.backends.external }}
{{- with include "unicache.backendSelector" . }}
{{- if $e.dnsDiscovery }}{{ fail "backends.external: give selector or dnsDiscovery, not both" }}{{ end }}
{{- $p := $e.selectorPorts }}
{{- $q := list (printf "selector=%s" .) (printf "port=%v" $p.http) }}
{{- with $p.kvEvents }}{{ $q = append $q (printf "kv-events=%v" .) }}{{ end }}
{{- with $p.replay }}{{ $q = append $q (printf "replay=%v" .) }}{{ end }}
{{- printf "k8s://%s?%s" ($e.namespace | default $.Release.Namespace) (join "&" $q) }}
{{- else }}
{{- $e.dnsDiscovery }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"true" when the vLLM pods publish their KV events to the router (`backends.vllm.publishToRouter`):
the router binds `routerEventsPort` (`--kv-events-listen`). One router process must hold it,
as each pod publishes to one address: anything else fails the render.
*/}}
{{- define "unicache.eventsToRouter" -}}
{{- if and (eq .Values.backends.mode "vllm") .Values.backends.vllm.publishToRouter }}
{{- $r := .Values.router }}
{{- if or $r.autoscaling.enabled (ne (int $r.replicaCount) 1) (ne (int $r.workers) 1) }}
{{- fail "backends.vllm.publishToRouter needs one router process (router.autoscaling.enabled=false, router.replicaCount=1, router.workers=1): each vLLM pod publishes its events to one address" }}
{{- end }}true
{{- end }}
{{- end }}

{{/* The router's ServiceAccount (only with an external selector: it reads EndpointSlices). */}}
{{- define "unicache.routerServiceAccount" -}}
{{- include "unicache.componentName" (dict "ctx" . "component" "router") }}
{{- end }}

{{/*
The `vllm serve` arguments of a backend pod: the model from the chart's weights options,
prefix caching, UniCache's scheduler with its eviction policy, KV events on wildcard
endpoints (the router connects to the pod), prompt-token details (cached_tokens in usage)
and the block size the router hashes with.
*/}}
{{- define "unicache.vllmArgs" -}}
{{- $v := .Values.backends.vllm }}
{{- $checkpoint := include "unicache.checkpointPath" . }}
{{- if not $checkpoint }}
{{- fail "backends.mode=vllm needs a model: model.source (or replicas.checkpoint), a local Hugging Face model directory mounted in the vLLM pods" }}
{{- end }}
{{- $unicache := dict "unicache" (dict "eviction_policy" $v.evictionPolicy) }}
{{- $events := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $v.kvEventsPort)) "replay_endpoint" (printf "tcp://*:%d" (int $v.replayPort)) }}
{{- if include "unicache.eventsToRouter" . }}
{{- /* a host address: vLLM connects to the router; Kubernetes expands $(POD_NAME) from the container's env */}}
{{- $router := printf "%s.%s.svc.cluster.local" (include "unicache.componentName" (dict "ctx" . "component" "router")) .Release.Namespace }}
{{- $_ := set $events "endpoint" (printf "tcp://%s:%d" $router (int $v.routerEventsPort)) }}
{{- $_ := set $events "topic" "$(POD_NAME)" }}
{{- end }}
- serve
- {{ $checkpoint | quote }}
- --host
- "0.0.0.0"
- --port
- {{ $v.port | quote }}
- --served-model-name
- {{ include "unicache.servedModelName" . | quote }}
- --block-size
- {{ .Values.settings.blockSize | quote }}
- --enable-prefix-caching
- --scheduler-cls
- unicache.replica.engines.vllm.scheduler.UniCacheScheduler
- --additional-config
- {{ toJson $unicache | quote }}
- --kv-events-config
- {{ toJson $events | quote }}
- --enable-prompt-tokens-details
- --tensor-parallel-size
- {{ $v.tensorParallelSize | quote }}
{{- with $v.gpuMemoryUtilization }}
- --gpu-memory-utilization
- {{ . | quote }}
{{- end }}
{{- with $v.maxModelLen }}
- --max-model-len
- {{ . | quote }}
{{- end }}
{{- if $v.enforceEager }}
- --enforce-eager
{{- end }}
{{- range $v.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
