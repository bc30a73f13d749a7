"""The calibration job's raw figures as a :class:`~hpcsplit.core.calibration.Calibration` (pure: no MPI, no torch).

[Note: calibration fit]
From ``[Note: calibration measurements]`` (:mod:`hpcsplit.launch.calibrate_run`):

- **CPU per batch and per request** of a component: its CPU seconds at saturation, batch 1 and batch 32, solve
  ``cpu = a * batches + b * requests`` (``component_us_per_message = a / 2``: one message in, one out;
  ``component_us_per_request = b``); the frontend's the same way, ``cpu = c * requests + d * messages``;
  where the job counted the frontend's working passes (their number and thread CPU, in both saturation runs and
  the ``turns`` run), ``c`` and ``d`` come from the saturation runs' working-pass CPU (the process's CPU also
  counts the passes that found nothing, which the simulator charges as the spin), and ``frontend_us_per_turn``
  is what a pass of the ``turns`` run (one request in flight: a pass admits one request and sends one message,
  or takes one answer) costs beyond that: ``(its CPU - c * requests - d * 2 requests) / passes``, at least 0;
- **links**: on one node the back-to-back ping-pong's one-way time (send to the replica's program) less the
  replica's CPU before it (``recv = a / 2 + b``) is ``m + bytes / bandwidth`` at each size: ``m`` is the latency
  of a small message to a busy rank; across nodes (no common clock) the round trip is ``2 m + turn + 2 * bytes /
  bandwidth`` (``turn = a + b``);
- **hop** to a rank idle ``g`` (the idle time the replica had, measured): the one-way time less ``recv`` (across
  nodes: the round trip less ``turn`` less the way back ``m``), its samples' trimmed mean, at least ``m``;
  ``hop_p90``: that times one spread pooled over the gaps (``[Note: hop spread]``); ``cross_extra``: the cross-node
  hop less the same-node hop at the same nominal gap;

- **frontend timer**: the runtime frontend's median admission lag (admit - arrival) with requests ``g`` apart,
  against its idle time (``g`` less the pipeline time);
- **idle CPU** (``[Note: idle CPU]``): the ping-pong replica stamps its process's CPU seconds into each
  answer, so successive answers differ by the CPU of one request and the idle time before it; the median of
  those differences at a gap less their median back to back (the smallest stream) is the CPU of an idle gap,
  against the replica's idle time (0 at least, increasing);
- **evicted caches** (``[Note: evicted caches]``): a turn straight after another rank's turn on the same core less
  the warm turn straight after it, the pairs' median (at least 0): per program (``ProgramCal.evicted_ms``: take a
  message, the program, send its outputs), for a turn with no program (``cpu.evicted_us_per_turn``) and for an
  idle rank's wake-up that finds nothing, in CPU time (``cpu.evicted_us_per_wake``); 0 where the job could not
  pin two ranks to one core, and for an older job's figures;
- **wake-up placement** (``[Note: stacked wake-ups]``): ``wake_on_ringer_core``, the share of the placement step's
  rings whose peer woke on rank 0's core (null when the step did not run: no doorbell, no ``sched_getcpu``);
- **compute**: GFLOP/s per thread count; ``corun_slowdown[k-1]`` = one rank's rate alone over the mean rate of
  ``k`` ranks computing at once; cold extras = the median, over runs after a gap, of the run less the warm run
  straight after it (``[Note: cold extra in pairs]``; an older job's figures: median after the gap less median
  back to back), 0 at least.

[Note: hop spread]
A hop to a rank idle a millisecond or two is bimodal on the development VM: 0.08-0.12 ms or 0.19-0.39 ms, in
proportions that change from one calibration to the next (``[Note: settled gaps]``).  With 20 samples a gap, the
median jumped between the two modes (at 2 ms: 0.39 ms in one calibration, 0.13 in the next, ten minutes apart), and
the 90th percentile was one or two outliers: 1.62 ms against a median of 0.13 once, which the simulator's lognormal
spread (sigma from p90 / p50) turned into a p99 of 13 ms for every hop at that gap; the toy's split at 256 req/s was
then predicted at a p99 of 89 ms against 5 measured.  So a gap's hop is its samples' trimmed mean (``_trimmed``: 10 %
off each end, at least one sample each end from three samples on), which moves with the mix instead of jumping, and
``hop_p90`` is that times one spread for every gap: the 90th percentile of the samples over their gap's hop, pooled
(about 240 samples), over the gaps whose hop is above twice ``m`` (a hop near ``m``, a rank still spinning, makes
any jitter a large ratio), at most :data:`HOP_SPREAD_MAX`.  The simulator takes ``hop`` as its lognormal's median.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hpcsplit import __version__
from hpcsplit.core.calibration import HOP_SPREAD_MAX, Calibration, Curve, Link, ProgramCal, utc_now

__all__ = ["fit"]


def _med(v: Sequence[float]) -> float:
    return float(np.median(v)) if len(v) else math.nan


def _trimmed(v: Sequence[float] | np.ndarray, cut: float = 0.1) -> float:
    """Mean of ``v`` less its ``cut`` smallest and largest share, at least one value off each end from three values
    on (at least one kept; NaN when empty).

    Examples
    --------
    >>> _trimmed([1.0] * 9 + [100.0]), _trimmed([0.1] * 10 + [0.3] * 10), round(_trimmed([0.8] * 7 + [16.0]), 9)
    (1.0, 0.2, 0.8)
    """
    a = np.sort(np.asarray(v, dtype=float))
    n = len(a)
    k = min((n - 1) // 2, max(1, int(n * cut + 0.5))) if n >= 3 else 0
    return float(a[k : n - k].mean()) if n else math.nan


def _var(v: Sequence[float]) -> float:
    """A robust variance (from the interquartile range)."""
    if len(v) < 4:
        return 0.0
    q1, q3 = np.quantile(v, [0.25, 0.75])
    return float(((q3 - q1) / 1.349) ** 2)


def _solve2(x1: tuple[float, float], y1: float, x2: tuple[float, float], y2: float) -> tuple[float, float] | None:
    """``(a, b)`` with ``a * x[0] + b * x[1] = y`` for both rows, both >= 0; None when that fails."""
    m = np.array([x1, x2], dtype=float)
    if abs(np.linalg.det(m)) < 1e-12:
        return None
    a, b = np.linalg.solve(m, np.array([y1, y2], dtype=float))
    return (float(a), float(b)) if a >= 0 and b >= 0 else None


def _cpu(chains: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    """(component s per batch, per request, frontend s per request, per message, per working pass) from the
    saturation runs and the ``turns`` run (``[Note: calibration fit]``)."""
    s1, s32 = chains.get("saturation b1", {}), chains.get("saturation b32", {})
    c1, c32 = s1.get("component", {}), s32.get("component", {})
    f1, f32 = s1.get("saturation", {}), s32.get("saturation", {})
    if not (c1 and f1):
        return 20e-6, 0.0, 200e-6, 0.0, 0.0
    per_batch = c1["cpu_s"] / max(1, c1["batches"])
    ab = None
    if c32:
        ab = _solve2((c1["batches"], c1["requests"]), c1["cpu_s"], (c32["batches"], c32["requests"]), c32["cpu_s"])
    a, b = ab if ab is not None else (per_batch, 0.0)
    fe_req = f1["frontend_cpu_s"] / max(1, f1["requests"])
    if not (c32 and f32):
        return a, b, fe_req, 0.0, 0.0
    m1 = 2 * c1["batches"] * f1["requests"] / max(1, c1["requests"])
    m32 = 2 * c32["batches"] * f32["requests"] / max(1, c32["requests"])
    t = chains.get("turns", {}).get("turns", {})
    if all(r.get("turns", 0) > 0 and "turn_cpu_s" in r for r in (f1, f32, t)):
        # one measure throughout: the working passes' thread CPU (an older job's figures have none)
        cd = _solve2((f1["requests"], m1), f1["turn_cpu_s"], (f32["requests"], m32), f32["turn_cpu_s"])
        c, d = cd if cd is not None else (f1["turn_cpu_s"] / max(1, f1["requests"]), 0.0)
        n = t["requests"]
        return a, b, c, d, max(0.0, (t["turn_cpu_s"] - c * n - d * 2 * n) / t["turns"])
    cd = _solve2((f1["requests"], m1), f1["frontend_cpu_s"], (f32["requests"], m32), f32["frontend_cpu_s"])
    c, d = cd if cd is not None else (fe_req, 0.0)
    return a, b, c, d, 0.0


def _pingpong(pp: Mapping[str, Any], recv_ms: float, turn_ms: float,
              floor_ms: float) -> tuple[Link, dict[float, tuple[float, float, float]]]:
    """The link (latency to a busy rank, bandwidth) and, per nominal gap, ``(idle ms, hop ms, hop p90 ms)``.

    With one-way times (one clock) the hop is the one-way time less the replica's CPU before its program ran
    (``recv_ms``); from round trips it is the round trip less the replica's turn less the way back (``m``).
    """
    streams = sorted((int(v["bytes"]), v) for k, v in pp.items() if k.startswith("stream "))
    one_way = bool(streams) and all(math.isfinite(x) for _, v in streams for x in v.get("one_way_ms", [math.nan]))

    m, gb_s = floor_ms, 0.5
    sizes: tuple[int, ...] = ()
    ways: tuple[float, ...] = ()
    if streams:
        sz = np.array([b for b, _ in streams], dtype=float)
        per = np.array([(float(np.median(v["one_way_ms"])) - recv_ms) if one_way
                        else (float(np.median(v["rtt_ms"])) - turn_ms) / 2 for _, v in streams], dtype=float)
        m = max(floor_ms, float(per[0]))
        if len(streams) >= 2 and sz[-1] > sz[0]:
            slope = float(np.polyfit(sz, per, 1)[0])  # ms per byte one way
            if slope > 0:
                gb_s = min(1e4, 1.0 / (slope * 1e6))
        sizes = tuple(int(x) for x in sz)
        ways = tuple(float(max(floor_ms, x)) for x in per)
    # [Note: hop spread]: each gap's hop is its samples' trimmed mean; the spread is pooled over every gap
    gaps: dict[float, tuple[float, np.ndarray]] = {}
    for k, v in pp.items():
        if k.startswith("gap ") and v["rtt_ms"]:
            # one way, or the round trip less the replica's turn and the way back to a rank that just sent
            h = (np.asarray(v["one_way_ms"], dtype=float) - recv_ms if one_way
                 else np.asarray(v["rtt_ms"], dtype=float) - turn_ms - m)
            gaps[float(v["gap_ms"])] = (_med(v["idle_ms"]), h[np.isfinite(h)])
    centre = {g: max(m, _trimmed(h)) if h.size else m for g, (_, h) in gaps.items()}
    ratios = [h / centre[g] for g, (_, h) in gaps.items() if h.size and centre[g] > 2 * m]
    ratio = min(HOP_SPREAD_MAX, max(1.0, float(np.quantile(np.concatenate(ratios), 0.9)))) if ratios else 1.0
    hops = {g: (idle, centre[g], centre[g] * ratio) for g, (idle, _) in gaps.items()}
    return Link(float(m), float(gb_s), sizes, ways), hops


def _cycle_cpu_ms(v: Mapping[str, Any]) -> float:
    """Median CPU ms of the replica between successive answers (its stamps' differences; NaN without stamps)."""
    c = np.asarray(v.get("cpu_ms") or [], dtype=float)
    d = np.diff(c[np.isfinite(c)])
    d = d[d >= 0]
    return float(np.median(d)) if d.size else math.nan


def _idle_cpu(pp: Mapping[str, Any], hops: Mapping[float, tuple[float, float, float]]) -> Curve:
    """CPU ms of an idle gap against the replica's idle ms (``[Note: idle CPU]``); zero without stamps."""
    streams = sorted((int(v["bytes"]), v) for k, v in pp.items() if k.startswith("stream "))
    base = _cycle_cpu_ms(streams[0][1]) if streams else math.nan
    if not math.isfinite(base):
        return Curve.constant(0.0)
    pts = [(0.0, 0.0)]
    for k, v in pp.items():
        if k.startswith("gap ") and float(v["gap_ms"]) in hops:
            pts.append((hops[float(v["gap_ms"])][0], _cycle_cpu_ms(v) - base))
    c = _increasing(pts)
    return Curve(c.gaps_ms, tuple(itertools.accumulate(c.values_ms, max)))  # CPU only grows with the gap


def _increasing(points: list[tuple[float, float]]) -> Curve:
    """A curve through ``points`` (gap, value), dropping gaps that do not increase."""
    gs: list[float] = []
    vs: list[float] = []
    for g, v in sorted(points):
        if math.isfinite(v) and (not gs or g > gs[-1]):
            gs.append(float(g))
            vs.append(float(max(0.0, v)))
    return Curve(tuple(gs), tuple(vs)) if gs else Curve.constant(0.0)


def _cold(b2b: Sequence[float], after: Mapping[str, Sequence[float]],
          warm: Mapping[str, Sequence[float]] | None = None) -> Curve:
    """The extra after each gap: the median of (cold run - the warm run straight after it) where the pairs are
    there (``[Note: cold extra in pairs]``), else (an older job's figures) median after the gap - median back
    to back."""
    base = _med(b2b)
    pts = [(0.0, 0.0)]
    for g, v in after.items():
        w = (warm or {}).get(g)
        if w is not None and len(w) == len(v) and len(v) > 0:
            pts.append((float(g), _med([a - b for a, b in zip(v, w, strict=True)])))
        else:
            pts.append((float(g), _med(v) - base))
    return _increasing(pts)


def _evicted(v: Mapping[str, Any] | None) -> float:
    """ms a turn costs straight after another rank's turn on its core beyond the warm turn straight after it (the
    pairs' median, at least 0; 0 for an older job's figures, which have none: ``[Note: evicted caches]``)."""
    c, w = (v or {}).get("evicted_ms") or [], (v or {}).get("warm_ms") or []
    if not c or len(c) != len(w):
        return 0.0
    x = _med([a - b for a, b in zip(c, w, strict=True)])
    return max(0.0, x) if math.isfinite(x) else 0.0


def fit(raw: Mapping[str, Any]) -> Calibration:
    """``[Note: calibration fit]``: the raw figures of one calibration job as a :class:`Calibration`."""
    chains = raw.get("chains", {})
    notes: list[str] = []
    a, b, c, d, per_turn = _cpu(chains)
    turn_ms = (a + b) * 1e3  # a batch of one: the CPU the simulator charges itself
    recv_ms = (a / 2 + b) * 1e3  # the replica's CPU from a message's arrival to its program: one message, one request
    same, hops = _pingpong(chains.get("pingpong", {}), recv_ms, turn_ms, 0.002)
    idle_cpu = _idle_cpu(chains.get("pingpong", {}), hops)
    hop = [(0.0, same.latency_ms)] + [(h[0], h[1]) for _, h in sorted(hops.items())]
    p90 = [(0.0, same.latency_ms)] + [(h[0], h[2]) for _, h in sorted(hops.items())]
    timer = [(0.0, 0.0)]
    for k, v in sorted(chains.get("one", {}).items()):
        if k.startswith("gap "):
            timer.append((max(0.0, float(v["gap_ms"]) - _med(v["pipe_ms"])), _med(v["lag_ms"])))
    cross_link, cross_extra = None, Curve.constant(0.0)
    if chains.get("pingpong cross"):
        cross_link, xhops = _pingpong(chains["pingpong cross"], recv_ms, turn_ms, same.latency_ms)
        pts = [(0.0, cross_link.latency_ms - same.latency_ms)]
        pts += [(hops[g][0], xh[1] - hops[g][1]) for g, xh in sorted(xhops.items()) if g in hops]
        cross_extra = _increasing(pts)
    gflops = {int(k): float(v) for k, v in (raw.get("gflops") or {"1": 30.0}).items()}
    rates = raw.get("corun_gflops") or {}
    alone = _med(rates.get("1", [])) if rates.get("1") else math.nan
    corun = [1.0]
    for k in sorted((int(k) for k in rates), key=int):
        if k >= 2 and rates[str(k)] and math.isfinite(alone):
            corun.append(max(1.0, alone / float(np.mean(rates[str(k)]))))
    small = raw.get("small") or {}
    cold = (_cold(small.get("b2b_ms", []), small.get("after_ms", {}), small.get("warm_ms")) if small
            else Curve.constant(0.0))
    progs: dict[str, ProgramCal] = {}
    sha = None
    shared = raw.get("shared_core") or {}
    praw = raw.get("programs")
    if praw:
        sha = praw.get("switchboard_sha256")
        for name, v in praw["programs"].items():
            progs[name] = ProgramCal(_med(v["b2b_ms"]), _cold(v["b2b_ms"], v["after_ms"], v.get("warm_ms")),
                                     _evicted((shared.get("programs") or {}).get(name)))
    hosts = tuple(dict.fromkeys(str(h) for h in raw.get("hosts", ())))
    return Calibration(
        source="measured", created_utc=utc_now(), hpcsplit_version=__version__, cluster=str(raw.get("cluster", "")),
        hosts=hosts, nodes=max(1, len(hosts)), cores_per_node=int(raw.get("cores_per_node") or 0),
        device_kind="cpu", hop=_increasing(hop), hop_p90=_increasing(p90), frontend_timer=_increasing(timer),
        compute_cold=cold, same_node=same, cross_node=cross_link, cross_extra=cross_extra,
        frontend_us_per_request=c * 1e6, frontend_us_per_message=d * 1e6,
        frontend_us_per_turn=per_turn * 1e6, evicted_us_per_turn=_evicted(shared.get("turn")) * 1e3,
        evicted_us_per_wake=_evicted(shared.get("wake")) * 1e3,
        component_us_per_message=a / 2 * 1e6, component_us_per_request=b * 1e6,
        compute_gflops=gflops, corun_slowdown=tuple(corun), switchboard_sha256=sha, programs=progs,
        notes=tuple(notes) + (f"measured in {float(raw.get('wall_s', 0.0)):.0f} s",), idle_cpu=idle_cpu,
        wake_on_ringer_core=_share((raw.get("placement") or {}).get("same_core")),
    )


def _share(flags: Sequence[bool] | None) -> float | None:
    """The share of true flags (the placement step's rings that woke the peer on the ringer's core); None: none."""
    return float(np.mean([bool(f) for f in flags])) if flags else None
