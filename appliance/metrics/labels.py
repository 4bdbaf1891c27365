"""The metrics' histogram buckets (vLLM v1's where vLLM has the metric) and the label values
they are primed with, so that every series exists from the first scrape (appliance.metrics.
registry)."""

from __future__ import annotations

# Buckets as vLLM v1 declares them.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# vLLM builds its per-request token buckets as 1, 2, 5, 10, 20, 50, ... up to max_model_len;
# the metrics exist before the model is known, so they go up to a 1M-token context.
REQUEST_TOKEN_BUCKETS = [m * 10**e for e in range(7) for m in (1, 2, 5)]

# Label values that exist at zero from the start (as vLLM pre-creates a child per finish reason),
# so a dashboard shows flat zeros on a new server instead of "No data". Every finish reason the
# engine and the API can report (vLLM's stop/length/abort/error; queue_full and queue_timeout
# are admission refusals, counted under vLLM's name as well); vLLM's "repetition" never happens
# here. A test holds this list to appliance.core.request.FinishReason.
FINISH_REASONS = ("stop", "length", "abort", "error", "queue_full", "queue_timeout", "ttft_slo")
PREEMPTION_MODES = ("recompute", "swap")  # swap falls back to recompute: both under either mode
# The core refuses on queue_full, queue_timeout and ttft_slo, the API on queue_full and
# estimated_wait.
CLASS_PAUSE_MODES = ("paused", "draining")
REJECTION_REASONS = ("queue_full", "queue_timeout", "ttft_slo", "estimated_wait", "class_paused")
DRAIN_OUTCOMES = ("drained", "cut")
KV_BLOCK_STATES = ("used", "cached", "free", "swapped")
