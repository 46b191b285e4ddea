{{/*
Names, labels and the pieces every nibble pod shares (model volume, TLS, secrets, etcd).
*/}}

{{- define "nibble.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nibble.fullname" -}}
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

{{/* The name of a component's objects: <fullname>-<component>. Call with (list $ "router"). */}}
{{- define "nibble.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "nibble.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nibble.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nibble.labels" -}}
helm.sh/chart: {{ include "nibble.chart" . }}
app.kubernetes.io/name: {{ include "nibble.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: nibble
{{- end }}

{{/* Selector labels of a component. Call with (list $ "router"). */}}
{{- define "nibble.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "nibble.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "nibble.componentLabels" -}}
{{ include "nibble.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "nibble.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nibble.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "nibble.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The served model name: model.name, else the model file's base name. */}}
{{- define "nibble.modelName" -}}
{{- default (base .Values.model.file) .Values.model.name }}
{{- end }}

{{- define "nibble.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.file) }}
{{- end }}

{{- define "nibble.modelClaimName" -}}
{{- default (printf "%s-models" (include "nibble.fullname" .)) .Values.model.pvc.claimName }}
{{- end }}

{{/* etcd client URLs, comma-separated. */}}
{{- define "nibble.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "http://%s:2379" (include "nibble.componentName" (list . "etcd")) }}
{{- else }}
{{- if not .Values.etcd.external.endpoints }}
{{- fail "etcd.enabled is false: set etcd.external.endpoints to the client URLs of your etcd" }}
{{- end }}
{{- join "," .Values.etcd.external.endpoints }}
{{- end }}
{{- end }}

{{- define "nibble.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "nibble.fullname" .)) .Values.auth.apiKey.existingSecret }}
{{- end }}

{{- define "nibble.internalTokenSecretName" -}}
{{- default (printf "%s-internal-token" (include "nibble.fullname" .)) .Values.auth.internalToken.existingSecret }}
{{- end }}

{{/* Checks of values that would otherwise render a cluster that cannot work. */}}
{{- define "nibble.validate" -}}
{{- if not (has .Values.kv.dtype (list "nvfp4" "fp8" "bf16")) }}
{{- fail (printf "kv.dtype must be nvfp4, fp8 or bf16, got %v" .Values.kv.dtype) }}
{{- end }}
{{- if not (has .Values.model.source (list "pvc" "hostPath" "download")) }}
{{- fail (printf "model.source must be pvc, hostPath or download, got %v" .Values.model.source) }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) (not .Values.model.pvc.create) }}
{{- fail "model.source is pvc: set model.pvc.claimName to an existing claim, or model.pvc.create: true" }}
{{- end }}
{{- if and (eq .Values.model.source "download") (not .Values.model.download.url) (not .Values.model.download.command) }}
{{- fail "model.source is download: set model.download.url (or model.download.command)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled: set tls.secretName to a secret holding tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if and .Values.auth.apiKey.enabled (not .Values.auth.apiKey.existingSecret) (not .Values.auth.apiKey.value) }}
{{- fail "auth.apiKey.enabled: set auth.apiKey.existingSecret (or, for tests, auth.apiKey.value)" }}
{{- end }}
{{- if not (or .Values.auth.internalToken.enabled .Values.tls.enabled .Values.networkPolicy.enabled) }}
{{- fail "auth.internalToken.enabled is false and tls.enabled too: anyone on the pod network could call the workers' internal API. Keep the internal token (the default), or enable tls, or enable networkPolicy (only this release's pods then reach the workers)" }}
{{- end }}
{{- if and .Values.etcd.enabled (gt (int .Values.etcd.replicas) 1) (not .Values.etcd.persistence.enabled) }}
{{- fail "etcd.replicas > 1 needs etcd.persistence.enabled: a member restarted without its data cannot rejoin" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $w := index $.Values $role }}
{{- if not (has $w.kind (list "Deployment" "StatefulSet")) }}
{{- fail (printf "%s.kind must be Deployment or StatefulSet, got %v" $role $w.kind) }}
{{- end }}
{{- end }}
{{- include "nibble.validatePlanner" . }}
{{- end }}

{{/* Checks of the planner's values and of the autoscalers that follow it. */}}
{{- define "nibble.validatePlanner" -}}
{{- $p := .Values.planner }}
{{- $a := $p.autoscaling }}
{{- if and $p.enabled (not .Values.metrics.enabled) }}
{{- fail "planner.enabled needs metrics.enabled: the planner reads TTFT and ITL from the routers' metrics port and serves nibble_planner_desired_workers on its own" }}
{{- end }}
{{- if lt (int $p.intervalMs) (int $p.loadPollMs) }}
{{- fail (printf "planner.intervalMs (%v) must be at least planner.loadPollMs (%v): each decision needs a fresh load reading" $p.intervalMs $p.loadPollMs) }}
{{- end }}
{{- if and $a.hpa.enabled $a.keda.enabled }}
{{- fail "planner.autoscaling: turn on hpa or keda, not both: two autoscalers would fight over the decode workers (KEDA makes an HPA of its own)" }}
{{- end }}
{{- if and (or $a.hpa.enabled $a.keda.enabled) (not $p.enabled) }}
{{- fail "planner.autoscaling follows the planner's nibble_planner_desired_workers: it needs planner.enabled" }}
{{- end }}
{{- if and $a.keda.enabled (not $a.keda.serverAddress) }}
{{- fail "planner.autoscaling.keda.enabled: set planner.autoscaling.keda.serverAddress to the URL of the Prometheus that scrapes the planner" }}
{{- end }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "planner.autoscaling.minReplicas (%v) is above maxReplicas (%v)" $a.minReplicas $a.maxReplicas) }}
{{- end }}
{{- if and $a.hpa.enabled (lt (int $a.minReplicas) 1) }}
{{- fail "planner.autoscaling.minReplicas is 0: a HorizontalPodAutoscaler cannot scale to zero (use keda, or 1)" }}
{{- end }}
{{- if and $a.hpa.enabled (gt (int .Values.prefill.replicas) 0) }}
{{- fail (printf "planner.autoscaling.hpa sets the decode workers to the planner's whole desired total and cannot subtract prefill.replicas (%v): set prefill.replicas to 0 (the planner turns decode workers into prefill ones) or use keda" .Values.prefill.replicas) }}
{{- end }}
{{- end }}

{{/* "true" when an autoscaler (planner.autoscaling) owns the decode workers' replicas, else "". */}}
{{- define "nibble.autoscaled" -}}
{{- if and .Values.planner.enabled (or .Values.planner.autoscaling.hpa.enabled .Values.planner.autoscaling.keda.enabled) }}true{{ end }}
{{- end }}

{{/*
The labels (as JSON) that pick this release's planner series: planner.autoscaling.matchLabels, or
the service (and namespace) the chart's ServiceMonitor labels them with. Call with (list $ true)
to include the namespace (KEDA's queries are not namespaced; an HPA's are).
*/}}
{{- define "nibble.plannerMatchLabels" -}}
{{- $root := index . 0 }}
{{- $labels := $root.Values.planner.autoscaling.matchLabels }}
{{- if not $labels }}
{{- $labels = dict "service" (include "nibble.componentName" (list $root "planner")) }}
{{- if index . 1 }}
{{- $labels = dict "namespace" $root.Release.Namespace "service" (include "nibble.componentName" (list $root "planner")) }}
{{- end }}
{{- end }}
{{- toJson $labels }}
{{- end }}

{{/* Environment every nibble process shares: model, etcd, metrics, TLS, internal token. */}}
{{- define "nibble.commonEnv" -}}
- name: NIBBLE_MODEL
  value: {{ include "nibble.modelPath" . | quote }}
- name: NIBBLE_MODEL_NAME
  value: {{ include "nibble.modelName" . | quote }}
- name: NIBBLE_PAGE_SIZE
  value: {{ .Values.kv.pageSize | quote }}
- name: NIBBLE_ETCD_ENDPOINTS
  value: {{ include "nibble.etcdEndpoints" . | quote }}
{{- if .Values.metrics.enabled }}
- name: NIBBLE_METRICS_LISTEN
  value: {{ printf "0.0.0.0:%v" .Values.metrics.port | quote }}
{{- end }}
{{- include "nibble.securityEnv" . }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* TLS files and the internal token (router, workers and planner). */}}
{{- define "nibble.securityEnv" -}}
{{- if .Values.tls.enabled }}
- name: NIBBLE_TLS_CERT
  value: {{ printf "%s/tls.crt" .Values.tls.mountPath | quote }}
- name: NIBBLE_TLS_KEY
  value: {{ printf "%s/tls.key" .Values.tls.mountPath | quote }}
- name: NIBBLE_TLS_CA
  value: {{ printf "%s/ca.crt" .Values.tls.mountPath | quote }}
{{- end }}
{{- if .Values.auth.internalToken.enabled }}
- name: NIBBLE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "nibble.internalTokenSecretName" . }}
      key: {{ .Values.auth.internalToken.secretKey }}
{{- end }}
{{- end }}

{{/* Volume mounts every nibble container has. */}}
{{- define "nibble.commonVolumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes every nibble pod has. */}}
{{- define "nibble.commonVolumes" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "nibble.modelClaimName" . }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* The init container that waits for etcd (etcd.waitForEtcd). */}}
{{- define "nibble.waitForEtcd" -}}
{{- if .Values.etcd.waitForEtcd }}
- name: wait-for-etcd
  image: {{ include "nibble.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - /bin/bash
    - -c
    - |
      # Waits until every etcd endpoint accepts TCP connections (10 minutes at most).
      IFS=',' read -ra endpoints <<< "${NIBBLE_ETCD_ENDPOINTS}"
      for endpoint in "${endpoints[@]}"; do
        hostport="${endpoint#*://}"; hostport="${hostport%%/*}"
        host="${hostport%:*}"; port="${hostport##*:}"
        if [[ "${hostport}" != *:* ]]; then host="${hostport}"; port=2379; fi
        ready=""
        for _ in $(seq 300); do
          if (exec 3<>"/dev/tcp/${host}/${port}") 2>/dev/null; then ready=1; break; fi
          sleep 2
        done
        if [[ -n "${ready}" ]]; then
          echo "etcd at ${hostport} accepts connections"
        else
          echo "etcd at ${hostport} still unreachable after 10 minutes; starting anyway" >&2
        fi
      done
  env:
    - name: NIBBLE_ETCD_ENDPOINTS
      value: {{ include "nibble.etcdEndpoints" . | quote }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests:
      cpu: 10m
      memory: 16Mi
    limits:
      memory: 64Mi
{{- end }}
{{- end }}

{{/* Init containers every nibble pod has: wait for etcd, fetch the model. */}}
{{- define "nibble.initContainers" -}}
{{- include "nibble.waitForEtcd" . }}
{{- if eq .Values.model.source "download" }}
- name: fetch-model
  image: {{ .Values.model.download.image }}
  imagePullPolicy: IfNotPresent
  {{- if .Values.model.download.command }}
  command:
    {{- toYaml .Values.model.download.command | nindent 4 }}
  {{- else }}
  command:
    - sh
    - -c
    - |
      set -eu
      target="{{ include "nibble.modelPath" . }}"
      if [ -s "$target" ]; then echo "model already at $target"; exit 0; fi
      mkdir -p "$(dirname "$target")"
      curl -fsSL --retry 5 -o "$target.part" "$MODEL_URL"
      mv "$target.part" "$target"
      echo "fetched $target"
  {{- end }}
  env:
    - name: HOME
      value: /tmp
    - name: MODEL_URL
      value: {{ .Values.model.download.url | quote }}
    - name: MODEL_PATH
      value: {{ include "nibble.modelPath" . | quote }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- with .Values.model.download.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
Anti-affinity of a component: soft (preferred), hard (required) or none, spreading replicas over
nodes. Call with (list $ "router" "soft").
*/}}
{{- define "nibble.antiAffinity" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- $mode := index . 2 }}
{{- if eq $mode "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "nibble.selectorLabels" (list $root $component) | nindent 10 }}
{{- else if eq $mode "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "nibble.selectorLabels" (list $root $component) | nindent 12 }}
{{- else if ne $mode "none" }}
{{- fail (printf "%s.antiAffinity must be soft, hard or none, got %v" $component $mode) }}
{{- end }}
{{- end }}

{{/*
A component's probes. Call with (dict "root" $ "probes" .probes "port" <grpc port>
"httpPort" <router HTTP port or 0>). Types: grpc (grpc.health.v1), http (/ready, /health), tcp.
*/}}
{{- define "nibble.probes" -}}
{{- $root := .root }}
{{- $p := .probes }}
{{- $type := $p.type }}
{{- if not $type }}
{{- $type = ternary "tcp" "grpc" $root.Values.tls.enabled }}
{{- end }}
{{- if and (eq $type "grpc") $root.Values.tls.enabled }}
{{- fail "probes.type grpc cannot be used with tls.enabled: Kubernetes' gRPC probes do not speak TLS (use tcp, or http on the router)" }}
{{- end }}
{{- if and (eq $type "http") (not .httpPort) }}
{{- fail "probes.type http needs the router's HTTP port (router.http.enabled)" }}
{{- end }}
{{- $scheme := ternary "HTTPS" "HTTP" $root.Values.tls.enabled }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $settings := index $p $kind }}
{{ $kind }}Probe:
  {{- if eq $type "grpc" }}
  grpc:
    port: {{ $.port }}
    service: ""
  {{- else if eq $type "http" }}
  httpGet:
    path: {{ ternary "/ready" "/health" (eq $kind "readiness") }}
    port: {{ $.httpPort }}
    scheme: {{ $scheme }}
  {{- else if eq $type "tcp" }}
  tcpSocket:
    port: {{ $.port }}
  {{- else }}
  {{- fail (printf "probes.type must be grpc, http or tcp, got %v" $type) }}
  {{- end }}
  periodSeconds: {{ $settings.periodSeconds }}
  failureThreshold: {{ $settings.failureThreshold }}
  timeoutSeconds: {{ default 5 $settings.timeoutSeconds }}
{{- end }}
{{- end }}
