"""`appliance console`'s command line; Textual is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys

POLL_S = 1.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("console", help="the operator's terminal UI (Textual) for a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (appliance up)")
    p.add_argument(
        "--admin-token-file",
        help="file holding the admin token "
        "(else $APPLIANCE_ADMIN_TOKEN; none: loopback servers without a token)",
    )
    p.add_argument("--readonly", action="store_true", help="hide every action that changes the box")
    p.add_argument("--poll", type=float, default=POLL_S, help="seconds between refreshes")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from appliance.console.app import ConsoleApp
    from appliance.console.client import ConsoleError, read_token

    try:
        token = read_token(ns.admin_token_file)
    except ConsoleError as exc:
        print(f"appliance console: {exc}", file=sys.stderr)
        return 2
    ConsoleApp(ns.url, token, readonly=ns.readonly, poll_s=ns.poll).run()
    return 0
