"""`appliance cluster up|status|apply|down|config`: the appliance across replicas on Ray Serve.

Everything a command is given is validated before Ray is touched: the cluster's settings
(settings.py), the template with its `--set` overrides (as `appliance up` validates them), then,
once connected, the GPUs the template needs against what the cluster has.

Without --address, `up` starts a local Ray and serves in the foreground until Ctrl-C or
SIGTERM (a local Ray ends with the process that started it); with --address it deploys onto
that cluster and returns. The other commands connect to --address (default: the Ray cluster
running on this machine)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from appliance.cluster.settings import ClusterConfig, cluster_config
from appliance.config import ConfigError
from appliance.config_sources import parse_sets

PUSH_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"


def _settings(ns: argparse.Namespace) -> ClusterConfig:
    raw: dict[str, Any] = {
        "template": ns.template,
        "overrides": parse_sets(ns.set),
        "replicas": ns.replicas,
        "port": ns.port,
        "host": ns.host,
        "name": ns.name,
    }
    for key in (
        "min_replicas",
        "max_replicas",
        "routing",
        "cpus_per_replica",
        "long_prompt_tokens",
        "long_template",
        "upscale_delay_s",
        "downscale_delay_s",
    ):
        value = getattr(ns, key, None)
        if value is not None:
            raw[key] = value
    cfg = cluster_config({k: v for k, v in raw.items() if v is not None})
    cfg.appliance_config()  # the template and overrides, checked before anything starts
    if cfg.long_prompt_tokens:
        cfg.appliance_config(cfg.long_template)
    return cfg


def _connect(address: str | None) -> None:
    import ray

    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        # The local Ray's replicas push their autoscaling figures every second, not every 10 s
        # (Ray's default): the policy then sees a step of load within seconds. On a cluster
        # of your own, set it in the environment `ray start` runs in.
        os.environ.setdefault(PUSH_INTERVAL_ENV, "1.0")
        ray.init(include_dashboard=False)


def cmd_up(ns: argparse.Namespace) -> int:
    cfg = _settings(ns)
    from ray import serve

    from appliance.cluster.app import build_app

    _connect(ns.address)
    try:
        app = build_app(cfg)  # the GPU check: before anything is deployed
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(app, name=cfg.name, route_prefix="/", blocking=False)
    except ConfigError:
        _disconnect(ns.address, cfg.name, deployed=False)
        raise
    print(
        f"appliance cluster {cfg.name!r}: {cfg.replicas} replica(s) of {cfg.template} behind "
        f"http://{cfg.host}:{cfg.port}/v1",
        flush=True,
    )
    if ns.address:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("stopping: the replicas drain", flush=True)
    _disconnect(None, cfg.name, deployed=True)
    return 0


def _disconnect(address: str | None, name: str, deployed: bool) -> None:
    import ray
    from ray import serve

    if deployed:
        serve.delete(name)
    if not address:
        serve.shutdown()
    ray.shutdown()


def status_rows(loads: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for r in loads:
        hits = r.prefix_cache_hits / r.prefix_cache_queries if r.prefix_cache_queries else 0.0
        rows.append(
            {
                "replica": r.replica_id,
                "pool": r.pool,
                "state": r.phase,
                "template": r.template,
                "waiting": r.num_waiting,
                "running": r.num_running,
                "est_wait_s": r.estimated_wait_s,
                "kv_usage": round(r.kv_usage, 3),
                "prefix_hit_rate": round(hits, 3),
                "url": r.url,
                "node": r.node,
            }
        )
    return rows


def cmd_status(ns: argparse.Namespace) -> int:
    from ray import serve

    _connect(ns.address or "auto")
    loads = serve.get_deployment_handle("directory", app_name=ns.name).snapshot.remote().result()
    app = serve.status().applications.get(ns.name)
    rows = status_rows(loads)
    if ns.json:
        deployments = (
            {n: d.replica_states for n, d in app.deployments.items()} if app is not None else {}
        )
        print(json.dumps({"replicas": rows, "deployments": deployments}, default=str))
        return 0
    print(f"application {ns.name}: {app.status if app is not None else 'not deployed'}")
    cols = [
        "replica",
        "pool",
        "state",
        "template",
        "waiting",
        "running",
        "kv_usage",
        "prefix_hit_rate",
        "url",
    ]
    print("  ".join(f"{c:<14}" for c in cols))
    for row in rows:
        print("  ".join(f"{str(row[c]):<14}" for c in cols))
    return 0


def cmd_apply(ns: argparse.Namespace) -> int:
    """A rolling template change: only the replicas' user_config changes, so Ray Serve
    reconfigures them one at a time (each drains and reloads) and the ingress stays up."""
    from ray import serve

    from appliance.cluster.app import build_app

    overrides = parse_sets(ns.set)
    _connect(ns.address or "auto")
    current = serve.get_app_handle(ns.name).settings.remote().result()
    cfg = cluster_config({**current, "template": ns.template, "overrides": overrides})
    cfg.appliance_config()
    serve.run(build_app(cfg), name=cfg.name, route_prefix="/", blocking=False)
    print(f"applied {ns.template} to {cfg.name!r}: the replicas reload one at a time")
    return 0


def cmd_down(ns: argparse.Namespace) -> int:
    from ray import serve

    _connect(ns.address or "auto")
    serve.delete(ns.name)
    print(f"removed {ns.name!r} (its replicas drained)")
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    """The Ray Serve config file equivalent to `cluster up` with these flags."""
    from appliance.cluster.app import serve_config

    cfg = _settings(ns)
    text = json.dumps(serve_config(cfg), indent=2)
    try:
        import yaml

        text = yaml.safe_dump(json.loads(text), sort_keys=False)
    except ImportError:  # JSON is YAML too
        pass
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--template", default="cpu-demo", help="template name or path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--replicas", type=int, default=1, help="replicas at start (default 1)")
    p.add_argument("--min-replicas", type=int, help="autoscaling floor (default --replicas)")
    p.add_argument("--max-replicas", type=int, help="autoscaling ceiling (above min: autoscale)")
    p.add_argument("--port", type=int, default=8000, help="the ingress's port (default 8000)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--routing", choices=["queue", "prefix"], help="replica choice (default prefix)")
    p.add_argument("--cpus-per-replica", type=float, help="Ray CPUs per replica (default 1)")
    p.add_argument("--long-prompt-tokens", type=int, help="longer prompts go to the long pool")
    p.add_argument("--long-template", help="the long pool's template (default --template)")
    p.add_argument("--upscale-delay-s", type=float)
    p.add_argument("--downscale-delay-s", type=float)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cluster", help="serve across replicas on Ray Serve (the cluster extra)")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", help="Ray cluster address (up: none starts a local Ray)")
    common.add_argument("--name", default="appliance", help="application name in Ray Serve")

    up = csub.add_parser("up", parents=[common], help="deploy (local Ray: in the foreground)")
    _add_cluster_flags(up)
    up.set_defaults(func=cmd_up)

    st = csub.add_parser("status", parents=[common], help="replicas, states, KV, queues")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    ap = csub.add_parser("apply", parents=[common], help="switch the template, rolling")
    ap.add_argument("--template", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.set_defaults(func=cmd_apply)

    dn = csub.add_parser("down", parents=[common], help="remove the application")
    dn.set_defaults(func=cmd_down)

    cf = csub.add_parser("config", parents=[common], help="print the Ray Serve config file")
    _add_cluster_flags(cf)
    cf.set_defaults(func=cmd_config)
