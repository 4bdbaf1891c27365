"""The cluster's settings: one Struct, validated before anything starts (a bad value names
itself), built from the `appliance cluster` flags or the `args` of a Ray Serve config file."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from appliance.config import ApplianceConfig, ConfigError, load_config

PositiveFloat = Annotated[float, Meta(gt=0.0)]


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # The appliance template every replica serves (name or path; a path must exist on every
    # node) and its `--set` overrides, as `appliance up` takes them.
    template: str = "cpu-demo"
    overrides: dict[str, Any] = {}
    # Replicas at start; with max_replicas above min_replicas the autoscaler moves between them.
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    # Where the ingress listens (Ray Serve's HTTP proxy).
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    # Application name in Ray Serve (one cluster of the appliance per name).
    name: str = "appliance"
    # How the ingress picks a replica: "prefix" sends requests that share their first
    # prefix_chars characters to one replica (its prefix cache hits) while that replica's load
    # stays within imbalance of the least loaded; "queue" always takes the least loaded.
    routing: Literal["queue", "prefix"] = "prefix"
    prefix_chars: Annotated[int, Meta(ge=1)] = 256
    imbalance: Annotated[int, Meta(ge=0)] = 4
    # Length routing (`appliance route`'s rule, shared code): prompts longer than this many
    # tokens go to the long_replicas replicas of their own deployment, served from
    # long_template; 0 = off.
    long_prompt_tokens: Annotated[int, Meta(ge=0)] = 0
    long_template: str = ""
    long_replicas: Annotated[int, Meta(ge=1)] = 1
    chars_per_token: PositiveFloat = 4.0
    # Each replica's Ray resources: CPU threads on a CPU box (the engine's torch threads follow
    # it unless hardware.engine_threads is set); GPUs come from the template (its TP degree).
    cpus_per_replica: PositiveFloat = 1.0
    # Autoscaling on the engines' own figures: a replica per target_waiting requests waiting
    # (summed over replicas), or more while the estimated wait of a new request is over
    # target_wait_s. Up fast, down slow (Ray Serve's delays).
    target_waiting: PositiveFloat = 4.0
    target_wait_s: PositiveFloat = 2.0
    upscale_delay_s: Annotated[float, Meta(ge=0.0)] = 5.0
    downscale_delay_s: Annotated[float, Meta(ge=0.0)] = 60.0
    # The window Ray Serve averages the replicas' reports over before each decision.
    look_back_period_s: PositiveFloat = 5.0
    # How long the ingress keeps a request while no replica is ready to take it (one reloading
    # or restarting, the cluster just started) before it answers 503.
    wait_for_replica_s: Annotated[float, Meta(ge=0.0)] = 10.0
    # How often each replica reports its load to the directory the ingress reads.
    report_interval_s: PositiveFloat = 0.25

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas {self.replicas}: a cluster needs at least 1 replica")
        lo = self.replicas if self.min_replicas is None else self.min_replicas
        hi = max(self.replicas, lo) if self.max_replicas is None else self.max_replicas
        if lo < 1:
            raise ConfigError(f"min_replicas {lo}: a cluster needs at least 1 replica")
        if hi < lo:
            raise ConfigError(f"max_replicas {hi} is below min_replicas {lo}")
        if not lo <= self.replicas <= hi:
            raise ConfigError(f"replicas {self.replicas} is outside [{lo}, {hi}]")
        if self.long_prompt_tokens and not self.long_template:
            self.long_template = self.template

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.lowest

    @property
    def lowest(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def highest(self) -> int:
        return max(self.replicas, self.lowest) if self.max_replicas is None else self.max_replicas

    def appliance_config(self, template: str | None = None) -> ApplianceConfig:
        """The template with its overrides, validated (ConfigError names a bad key)."""
        return load_config(template or self.template, self.overrides)


def cluster_config(raw: dict[str, Any]) -> ClusterConfig:
    try:
        return msgspec.convert(raw, ClusterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"cluster: {exc}") from None


def gpus_per_replica(config: ApplianceConfig, cluster_gpus: float) -> int:
    """A replica is one engine: its GPUs are the template's TP degree on CUDA (on `auto`,
    where the cluster has GPUs), none on a CPU box."""
    device = config.hardware.device
    if device == "cpu" or (device == "auto" and cluster_gpus <= 0):
        return 0
    return config.parallel.tensor_parallel_size


def check_gpus(cfg: ClusterConfig, per_replica: int, cluster_gpus: float) -> None:
    need = per_replica * cfg.lowest
    if need > cluster_gpus:
        raise ConfigError(
            f"template {cfg.template!r} asks for {per_replica} GPU(s) per replica x "
            f"{cfg.lowest} replicas = {need} GPUs; the cluster has {cluster_gpus:g}"
        )
