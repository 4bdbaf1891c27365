"""`appliance demo-model`: build an offline random demo model (appliance.models.demo_model),
optionally trained briefly on the shipped corpus (appliance.tools.train_demo)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from appliance.models.demo_model import build_demo_model
from appliance.models.demo_spec import ARCHS, SHAPES


def add_demo_model_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `demo-model` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "demo-model",
        help="build an offline random demo model in Hugging Face format",
        description="Build a deterministic random model (weights, config, tokenizer) that "
        "transformers and the appliance can load without any download.",
    )
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--shard-size", default=None, help='e.g. "2MB": save sharded weights')
    p.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="then train briefly on the shipped corpus (appliance.tools.train_demo)",
    )
    p.set_defaults(func=demo_model_command)
    return p


def demo_model_command(args: argparse.Namespace) -> int:
    start = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)

    build_demo_model(
        args.shape,
        args.out,
        seed=args.seed,
        arch=args.arch,
        max_position_embeddings=args.max_position_embeddings,
        shard_size=getattr(args, "shard_size", None),
        progress=progress,
    )
    if getattr(args, "train_steps", 0):
        from appliance.tools.train_demo import train_demo_model

        train_demo_model(args.out, args.train_steps, seed=args.seed, progress=progress)
    return 0
