"""Every default that more than one place needs, each written once (as Argo Rollouts'
``utils/defaults``). The CRD's schema repeats the ModelDeployment ones for the API server;
a test checks that they agree."""

from __future__ import annotations

# --- ModelDeployment spec (the CRD's `default:` values) ---------------------------------
REPLICAS = 1  # pods of a ModelDeployment
BACKEND = "tensorrt"  # the production backend
# engine precision asked of the backend: "model" is what the ONNX graph carries (strongly
# typed: the only way TensorRT 11 builds, and the same on 10); fp16 on an fp32 graph works
# on TensorRT 10 only; int8 needs an explicitly quantized (Q/DQ) graph
PRECISION = "model"
PRECISIONS = ("model", "fp32", "fp16", "int8")
GPUS = 1  # GPU_RESOURCE per pod
# the extended resource the GPUs are asked as (spec.resources.gpuResource): a whole GPU, or
# a MIG slice such as nvidia.com/mig-1g.10gb
GPU_RESOURCE = "nvidia.com/gpu"
CANARY_PERCENT = 0  # share of pods in the canary; 0 = no canary stage
CANARY_PAUSE_SECONDS = 30.0  # hold a healthy canary this long before promoting
MANUAL_PROMOTE = False  # hold the canary until the promote annotation names the version
CANARY_TRAFFIC_PERCENT = 0  # share of a canary pod's requests its candidate answers
CANARY_SHADOW_PERCENT = 0  # share of its stable answers also run on the candidate
# spec.canary.shadow.percent: in the canary's shadow step (before any live share), the
# share of the canary pods' stable answers also run on the candidate. 100: every request
# runs twice on a canary pod (its compute doubles for the step), and the step gets
# minRequests soonest
CANARY_SHADOW_STEP_PERCENT = 100
# spec.canary.analysis (when present): a check of the canary's figures every interval,
# judged only on at least ANALYSIS_MIN_REQUESTS requests (else inconclusive); this many
# failed checks roll the canary back
ANALYSIS_INTERVAL_SECONDS = 30.0
ANALYSIS_MIN_REQUESTS = 50
ANALYSIS_FAILURE_LIMIT = 2
ANALYSIS_MAX_ERROR_RATE = 0.01  # 5xx answers per request of the candidate
ANALYSIS_MAX_LATENCY_RATIO = 1.5  # candidate p99 / stable p99
ANALYSIS_MAX_NON_FINITE = 0  # NaN or ±Inf output values of the candidate per check
# an analysis that cannot conclude in time (spec.canary.analysis.inconclusiveLimit,
# inconclusiveDeadlineSeconds): the canary is rolled back ("rollback") or held ("hold")
ANALYSIS_ON_INCONCLUSIVE = "rollback"
# spec.tenants.jwt / the server's --jwt-* flags: tenants' JWTs, verified with asymmetric
# algorithms only (a verifying key is public: an HMAC "key" would be a secret)
JWT_ASYMMETRIC_ALGORITHMS = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)  # fmt: skip
JWT_ALGORITHMS = ("RS256", "ES256", "EdDSA")
JWT_LEEWAY_SECONDS = 30.0  # clock skew allowed on exp and nbf
JWT_TENANT_CLAIM = "tenant"
BATCH_PERCENT = 25  # batch size as a share of replicas, when batchSize is not given
JITTER_SECONDS = 5.0  # random pause of up to this between batches
MAX_UNAVAILABLE = 0  # pods that may be not ready before a batch starts
PROGRESS_DEADLINE_SECONDS = 600.0  # a batch (or the canary) must serve within this
# the longest a new target takes to reach a sidecar that cannot watch its pod (the
# kubelet's Downward API refresh: a sync period of about a minute, plus jitter); a pod's
# deadline counts from when its sidecar reports seeing the target, else from this late
MAX_SIGNAL_DELAY_SECONDS = 90.0
RETAIN_VERSIONS = 2  # versions each server keeps loaded, the serving one included
HISTORY_LIMIT = 10  # rollouts kept in status.history, most recent first
# spec.paused (kubectl model pause / resume): no rollout step starts while it is true
PAUSED = False
ALLOW_UNSIGNED = False  # sidecars verify Ed25519 signatures unless spec.allowUnsigned
# the programs' log lines (--log-format, --log-level; spec.logging for a pod's server and
# sidecars): text for people, json (one object per line) for a cluster's log pipeline
LOG_FORMAT = "text"
LOG_FORMATS = ("text", "json")
LOG_LEVEL = "info"
LOG_LEVELS = ("debug", "info", "warning", "error")

# --- pod layout (the operator writes it; server and sidecar are told by argv) -----------
SERVER_PORT = 8000  # KServe v2 HTTP inside the pod
# KServe v2 gRPC (inference.GRPCInferenceService) inside the pod: Triton's port beside its
# HTTP 8000, where tritonclient.grpc looks (a server started without --grpc-port has none)
SERVER_GRPC_PORT = 8001
SIDECAR_METRICS_PORT = 9100  # the sidecar's /metrics

# --- server ----------------------------------------------------------------------------
SERVER_BACKEND = "onnxruntime"  # the embedded default: runs on any CPU
SERVER_HOST = "127.0.0.1"  # listen on loopback unless told otherwise (pods say 0.0.0.0)
INFERENCE_WORKERS = 4  # inference threads
# dynamic batching (the server's --max-batch-size / --max-queue-delay-us, the CRD's
# spec.server.batching): queued requests of one version run together, up to this many
# rows (the first axis, as Triton's max_batch_size); 0 = off. A request waits at most
# the delay for others (Triton's max_queue_delay_microseconds), and only while the
# version has a free inference thread: busy, requests keep queueing
MAX_BATCH_SIZE = 0
MAX_QUEUE_DELAY_MICROSECONDS = 0
# the memory one request may take while it runs (the server's --request-memory-mb): a
# model's most rows per request, unless configured (--max-rows, the CRD's
# spec.server.maxRowsPerRequest), is this over the model's estimated memory per row
REQUEST_MEMORY_MB = 1024
# SIGTERM: readiness turns 503 at once, then the server keeps serving this long (so that
# endpoints and load balancers stop sending), waits for in-flight requests, then exits
DRAIN_SECONDS = 5.0
SERVER_PROCESSES = 1  # spec.server.processes: server processes behind the pod's one port
# the server container's preStop pause (the kubelet's native sleep action), before SIGTERM:
# endpoints and kube-proxy stop routing to the pod while it still serves at full width
PRESTOP_SLEEP_SECONDS = 5
# after the drain, what the last in-flight requests get before the kubelet's SIGKILL (the
# server's --inflight-grace-seconds: it cancels what still runs then, and exits)
INFLIGHT_GRACE_SECONDS = 20
# the pod's terminationGracePeriodSeconds: room for the preStop pause, the drain and the
# last in-flight requests (a longer spec.server.drainSeconds lengthens it to match)
TERMINATION_GRACE_SECONDS = PRESTOP_SLEEP_SECONDS + int(DRAIN_SECONDS) + INFLIGHT_GRACE_SECONDS

# --- sidecar ---------------------------------------------------------------------------
POLL_SECONDS = 2.0  # watch mode: between looks at the target
POLL_JITTER_SECONDS = 1.0  # watch mode: random extra delay, so a fleet does not poll at once
KEEP_VERSIONS_ON_DISK = RETAIN_VERSIONS + 1  # versions kept on the volume, serving included
STORE_ATTEMPTS = 5  # tries of one store operation before reporting an error
MAX_CONCURRENT_DOWNLOADS = 1  # downloads at once per sidecar
# storm controls: a fleet started (or told a new version) at once must not hit the store
# at once. A random pause of up to START_JITTER before init's first download and before
# watch's first poll; failed cycles back off exponentially (full jitter) between these.
START_JITTER_SECONDS = 2.0
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 60.0
# the resources of the sidecar and of the init container (and of each tenant model's), as a
# container's `resources:`; spec.resources.sidecar and spec.resources.prefetch replace them
# whole. Small, and with limits, so that a namespace whose LimitRange or ResourceQuota
# requires limits admits the pods (downloads stream to the volume: memory stays flat)
SIDECAR_REQUESTS = (("cpu", "50m"), ("memory", "128Mi"))
SIDECAR_LIMITS = (("cpu", "1"), ("memory", "512Mi"))
