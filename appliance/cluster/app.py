"""The Ray Serve application: a directory, the replica deployment(s) and the ingress, built
from one ClusterConfig, by `appliance cluster up` and by `serve deploy` (app_builder, the
import path of the config file `appliance cluster config` writes)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import msgspec

from appliance.cluster.directory import Directory
from appliance.cluster.ingress import ClusterIngress
from appliance.cluster.replica import ApplianceReplica
from appliance.cluster.routing import ReplicaLoad
from appliance.cluster.settings import (
    ClusterConfig,
    check_gpus,
    cluster_config,
    gpus_per_replica,
)

log = logging.getLogger("appliance.cluster")

# Headroom over the template's drain for Ray Serve's graceful stop of a replica.
STOP_HEADROOM_S = 30.0
IMPORT_PATH = "appliance.cluster.app:app_builder"


class IngressDeployment:
    """Ray Serve's side of the ingress: the ASGI app gets the directory's snapshots."""

    def __init__(self, directory: Any, cfg: dict[str, Any], *pools: Any) -> None:
        self.directory = directory
        self.cfg = cluster_config(cfg)
        self.pools = pools  # bound so that Ray Serve deploys them with the ingress

    def settings(self) -> dict[str, Any]:
        """The cluster's settings, for `appliance cluster apply` (the template aside: each
        replica reports the one it serves)."""
        return msgspec.to_builtins(self.cfg)

    def __serve_build_asgi_app__(self) -> ClusterIngress:
        return ClusterIngress(self._snapshot, self.cfg)

    async def _snapshot(self) -> list[ReplicaLoad]:
        loads: list[ReplicaLoad] = await self.directory.snapshot.remote()
        return loads


def user_config(cfg: ClusterConfig, template: str) -> dict[str, Any]:
    """What reaches each replica's reconfigure: the template and its overrides. The engine's
    torch threads follow the replica's CPUs unless the overrides set them."""
    overrides = dict(cfg.overrides)
    overrides.setdefault("hardware.engine_threads", max(1, int(cfg.cpus_per_replica)))
    return {"template": template, "overrides": overrides}


def replica_options(cfg: ClusterConfig, cluster_gpus: float, long: bool = False) -> dict[str, Any]:
    template = cfg.long_template if long else cfg.template
    appliance = cfg.appliance_config(template)
    gpus = gpus_per_replica(appliance, cluster_gpus)
    options: dict[str, Any] = {
        "name": "replica-long" if long else "replica",
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": gpus},
        "user_config": user_config(cfg, template),
        # Calls through Ray are only reports and reconfigures; the traffic is HTTP.
        "max_ongoing_requests": 1000,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": appliance.server.drain_timeout_s + STOP_HEADROOM_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        # Ray Serve logs a line per call; the replicas' calls are reports several times a second.
        "logging_config": {"enable_access_log": False},
    }
    if long:
        options["num_replicas"] = cfg.long_replicas
    elif cfg.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": cfg.lowest,
            "max_replicas": cfg.highest,
            "initial_replicas": cfg.replicas,
            "upscale_delay_s": cfg.upscale_delay_s,
            "downscale_delay_s": cfg.downscale_delay_s,
            "look_back_period_s": cfg.look_back_period_s,
            "policy": {
                "policy_function": "appliance.cluster.autoscale:QueueDepthPolicy",
                "policy_kwargs": {
                    "target_waiting": cfg.target_waiting,
                    "target_wait_s": cfg.target_wait_s,
                },
            },
        }
    else:
        options["num_replicas"] = cfg.replicas
    return options


def stable_version(deployment: Any, *identity: Any) -> Any:
    """The deployment under a version derived from what identifies its code and arguments.

    `serve.run` gives every deployment a random version on each call, so a second run (a
    template `apply`) would replace every replica and the ingress rather than reconfigure them.
    With the same version Ray Serve compares the rest: a changed user_config goes through the
    replicas' reconfigure, one at a time; changed resources still restart them (rolling).
    Ray 2.60 keeps `version` for its own use (`_internal`): without it, replacement it is."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("appliance")
    except PackageNotFoundError:
        package = "source"
    digest = hashlib.blake2b(msgspec.json.encode([package, *identity]), digest_size=8).hexdigest()
    try:
        return deployment.options(version=digest, _internal=True)
    except (TypeError, ValueError) as exc:
        log.warning("Ray Serve refused a deployment version (%s): apply will replace", exc)
        return deployment


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else 0.0


def build_app(cfg: ClusterConfig) -> Any:
    """The application; a template or GPU count the cluster cannot hold raises ConfigError
    before anything is deployed."""
    from ray import serve

    gpus = cluster_gpus()
    options = replica_options(cfg, gpus)
    check_gpus(cfg, options["ray_actor_options"]["num_gpus"], gpus)
    small = {
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 100_000,
        "logging_config": {"enable_access_log": False},
    }
    directory = stable_version(
        serve.deployment(Directory, name="directory", num_replicas=1, **small), "directory"
    ).bind()

    def pool(name: str, opts: dict[str, Any]) -> Any:
        deployment = serve.deployment(ApplianceReplica, **opts)
        # Autoscaling on or off is part of the identity: a replica sets up the push of its
        # autoscaling figures when it starts, so switching it on replaces the replicas.
        autoscaled = "autoscaling_config" in opts
        return stable_version(deployment, name, cfg.report_interval_s, autoscaled).bind(
            directory, name, cfg.report_interval_s
        )

    pools = [pool("default", options)]
    if cfg.long_prompt_tokens:
        pools.append(pool("long", replica_options(cfg, gpus, long=True)))
    # The ingress's arguments leave out the template: `cluster apply` changes only the
    # replicas' user_config, so Ray Serve rolls the replicas and keeps the ingress running.
    routing = msgspec.to_builtins(msgspec.structs.replace(cfg, template="", overrides={}))
    ingress = stable_version(
        serve.deployment(
            serve.ingress()(IngressDeployment), name="ingress", num_replicas=1, **small
        ),
        "ingress",
        routing,
    )
    return ingress.bind(directory, routing, *pools)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve deploy`'s entry: the config file's `args` are a ClusterConfig."""
    return build_app(cluster_config(args))


def serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """The Ray Serve config file equivalent to `appliance cluster up` with these settings."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": cfg.host, "port": cfg.port},
        "applications": [
            {
                "name": cfg.name,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": msgspec.to_builtins(cfg),
            }
        ],
    }
