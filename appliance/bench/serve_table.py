"""`bench serve`'s printed tables: throughput and goodput per row, then the latency
percentiles (TTFT, TPOT, ITL, end to end)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.bench.serve import Summary


def print_table(
    title: str,
    overall: Summary,
    per_class: dict[str, Summary],
    errors: dict[str, int],
    per_kind: dict[str, Summary] | None = None,
) -> None:
    """Rows: all, then each kind of request (where the profile has more than one), then each
    priority class sent."""
    print(title)
    rows = [("all", overall), *(per_kind or {}).items(), *per_class.items()]
    head = f"{'':<10} {'reqs':>5} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} {'goodput/s':>10}"
    print(head)
    print("-" * len(head))
    for name, s in rows:
        print(
            f"{name:<10} {s.requests:>5} {s.ok:>5} {s.request_throughput:>7.2f} "
            f"{s.output_token_throughput:>10.1f} {s.total_token_throughput:>10.1f} {s.goodput:>10.2f}"
        )
    head = (
        f"{'':<10} {'TTFT p50':>9} {'p90':>8} {'p99':>8} ms | {'TPOT p50':>9} {'p99':>7} ms | "
        f"{'ITL p50':>8} {'p99':>7} ms | {'E2E p50':>8} {'p99':>7} s"
    )
    print()
    print(head)
    print("-" * len(head))

    def f(v: float | None, w: int) -> str:
        return f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"

    for name, s in rows:
        print(
            f"{name:<10} {f(s.ttft_ms['p50'], 9)} {f(s.ttft_ms['p90'], 8)} {f(s.ttft_ms['p99'], 8)}    | "
            f"{f(s.tpot_ms['p50'], 9)} {f(s.tpot_ms['p99'], 7)}    | "
            f"{f(s.itl_ms['p50'], 8)} {f(s.itl_ms['p99'], 7)}    | "
            f"{f(s.e2e_s['p50'], 8)} {f(s.e2e_s['p99'], 7)}"
        )
    print(f"\nerrors by status: {errors or 'none'}")
