"""Open-loop load: the split-vs-whole table; arrival schedules and per-level summaries are
:mod:`hpcsplit.core.load`'s (re-exported here).

Open loop: request ``i`` *arrives* at ``arrivals_s[i]`` whether or not earlier ones finished; its latency
runs from that arrival to its last output, so queueing in front of a saturated system counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpcsplit.core.load import LevelSummary, arrival_times, summarize

__all__ = ["LevelSummary", "arrival_times", "format_table", "improvement_rows", "summarize"]


def improvement_rows(whole: Sequence[LevelSummary], split: Sequence[LevelSummary]) -> list[dict[str, float]]:
    """Per QPS: latency improvement % (p50, whole vs split) and throughput improvement % (achieved).

    Latency improvement = (whole - split) / whole * 100; throughput improvement =
    (split / whole - 1) * 100, as in the prototype's table.
    """
    by_q = {s.offered_qps: s for s in whole}
    rows = []
    for s in split:
        w = by_q.get(s.offered_qps)
        if w is None:
            continue
        rows.append({
            "qps": s.offered_qps,
            "latency_improvement_pct": (w.p50_ms - s.p50_ms) / w.p50_ms * 100 if w.p50_ms else float("nan"),
            "p99_improvement_pct": (w.p99_ms - s.p99_ms) / w.p99_ms * 100 if w.p99_ms else float("nan"),
            "throughput_improvement_pct": (s.achieved_qps / w.achieved_qps - 1) * 100
            if w.achieved_qps else float("nan"),
            "whole_p50_ms": w.p50_ms,
            "split_p50_ms": s.p50_ms,
            "whole_qps": w.achieved_qps,
            "split_qps": s.achieved_qps,
            "whole_ok": w.success_rate,
            "split_ok": s.success_rate,
        })
    return rows


def format_table(rows: Sequence[dict[str, float]]) -> str:
    """The prototype's summary table, with the measured figures beside the ratios."""
    head = (f"{'QPS':<8} {'Latency Improvement (%)':>24} {'Throughput Improvement (%)':>27} | "
            f"{'whole p50 ms':>12} {'split p50 ms':>12} {'whole req/s':>11} {'split req/s':>11} "
            f"{'ok whole/split':>15}")
    lines = ["Performance Improvement Summary:", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['qps']:<8g} {r['latency_improvement_pct']:>24.2f} {r['throughput_improvement_pct']:>27.2f} | "
            f"{r['whole_p50_ms']:>12.2f} {r['split_p50_ms']:>12.2f} {r['whole_qps']:>11.2f} "
            f"{r['split_qps']:>11.2f} {r['whole_ok']:>7.0%}/{r['split_ok']:<7.0%}"
        )
    lines.append("-" * len(head))
    return "\n".join(lines)
