"""Each hop of a traced run, measured against the calibration: ``python -m hpcsplit.bench hops RUN_DIR``.

    python -m hpcsplit stage=bench ... runtime.trace.start_step=0 runtime.trace.end_step=1000000
    python -m hpcsplit.bench hops outputs/<run> [--variant split [--qps 2048]] [--calibration PATH] [--out DIR]

A run traced with ``runtime.trace.*`` (``hpcsplit/runtime/trace.py``) has, per rank, spans of its receives,
computes and sends, each naming its requests and (a receive) its source.  For every request and every edge
``a -> b`` it went through, this reads:

* **gap**: how long ``b`` had been idle when the send started, since the end of its traced work before (the
  key of the calibrated curve, as the calibration's ping-pong keys it; 0 when ``b`` was working; a rank's first
  traced span has none and is left out, and a rank busy with requests outside the traced window between two
  traced ones shows a longer gap than it had);
* **busy**: how long after the send's start ``b`` was still working (on other requests): the message waited
  for it, which the simulator models as the rank's own queue, not as the hop;
* **hop**: from the later of the send's start and the end of ``b``'s work to the moment ``b`` took the
  message (the start of its ``recv`` span): what the calibration's ``hop`` is (``[Note: calibration fit]``: the
  sender's send, the wake-up, the message; not the receiver's CPU after it took it), with any wait for a core;
* **calibrated**: the calibration's ``hop`` at that gap (with ``--calibration``), what the simulator charges
  a message to a sleeping rank before any wait for a core (``[Note: simulator]``).

``--variant`` (and ``--qps``) keep the requests of one variant (and level) of a bench run, by the request ids
its ``bench/requests.h5`` holds; ``--simulate`` then simulates that level once as ``stage=simulate``'s first run
does (the plan, profile, schedule and seed of the run, under the calibration) and sets each edge's simulated
send-to-taken time (``simulate``'s ``hops``) beside the measured one (busy + hop), with its parts apart: the wait
for the receiver's work (``s.busy``, to set against the measured busy), the hop delay of a sleeping receiver
(``s.hop``) and the wait for a core (``s.core``; these two and the transfer against the measured hop).  The two start at different points: the measured time at the start of the sender's
send span (the frontend's covers admission and routing), the simulated one when the sender's job, which counts
that work, ends; and the simulation covers every request of the level, the trace only its window.  It prints one row per edge (medians over its requests: a message carrying
several requests counts once for each, as their latencies do), the sums over the edges, and writes ``hops.csv``
and ``hops.png`` (every hop against its gap, the calibrated curve over it) to ``--out`` (default: the run's
``trace/``).  Only ranks of one node share a clock: an edge between two hosts is named and left out.  The
trace files are read as untrusted input: a file that is not a trace this code wrote is refused by name.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import itertools
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from hpcsplit.core.calibration import Calibration, load_calibration
from hpcsplit.errors import HpcsplitError
from hpcsplit.launch.simulate import simulated_hops

__all__ = ["Hop", "main", "read_trace", "read_traces", "trace_hops"]

MAX_TRACE_BYTES = 256 << 20  # per rank file
_RANK_FILE = re.compile(r"rank(0|[1-9]\d{0,5})\.json")  # as the tracer names them
_SEND = {"send", "admit_send"}
_RECV = {"recv", "recv_output"}
_WORK = _SEND | _RECV | {"compute"}  # a rank's own work (serve mode's per-request span is not)


@dataclass(frozen=True)
class Span:
    name: str
    start_us: float
    end_us: float
    requests: tuple[int, ...]
    src: int | None
    n: int  # requests of the span (its list holds the first 64)
    cpu_us: float | None = None  # the rank's thread's CPU over the span (traces of stop 45 on: sends and compute)


@dataclass(frozen=True)
class Hop:
    """One request's way over one edge ``src -> dst`` (milliseconds)."""

    src: int
    dst: int
    request: int
    hop_ms: float  # from the later of the send's start and the receiver's end of work, to the message taken
    gap_ms: float  # how long the receiver had been idle when the send started (0: it was working)
    busy_ms: float  # how long after the send's start the receiver was still working (the message waited)


def _bad(path: Path, what: str) -> HpcsplitError:
    return HpcsplitError(f"{path} is not a trace of hpcsplit's runtime ({what}); trace a run with "
                         "runtime.trace.start_step=N runtime.trace.end_step=M and pass its run folder")


def _num(v: Any) -> TypeGuard[float]:
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def read_trace(path: str | Path) -> tuple[str, str | None, list[Span]]:
    """One rank's trace file: its label (``rank 1 stem``), its host (None in files of older versions) and its
    spans in time order.  Raises :class:`HpcsplitError` naming the file and what is wrong with it."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_TRACE_BYTES + 1)
    except OSError as e:
        raise HpcsplitError(f"cannot read trace file {p}: {e.strerror or e}") from e
    if len(data) > MAX_TRACE_BYTES:
        raise _bad(p, f"larger than {MAX_TRACE_BYTES >> 20} MiB")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise _bad(p, f"not JSON: {err}") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise _bad(p, "no traceEvents list")
    other = doc.get("otherData")
    host = other.get("host") if isinstance(other, dict) and isinstance(other.get("host"), str) else None
    label, spans = p.stem, []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise _bad(p, f"event {i} is not an object")
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            args = ev.get("args")
            if isinstance(args, dict) and isinstance(args.get("name"), str):
                label = args["name"][:80]
            continue
        if ev.get("ph") != "X":
            continue
        args = ev.get("args")
        name, ts, dur = ev.get("name"), ev.get("ts"), ev.get("dur")
        if not (isinstance(name, str) and _num(ts) and _num(dur) and dur >= 0 and isinstance(args, dict)):
            raise _bad(p, f"event {i} lacks a name, a finite ts and dur >= 0, or args")
        reqs, src = args.get("requests"), args.get("src")
        if not isinstance(reqs, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in reqs):
            raise _bad(p, f"event {i}'s requests are not a list of integers")
        if src is not None and (not isinstance(src, int) or isinstance(src, bool) or src < 0):
            raise _bad(p, f"event {i}'s src is not a rank")
        n = args.get("n", len(reqs))
        if not isinstance(n, int) or isinstance(n, bool) or n < len(reqs):
            raise _bad(p, f"event {i}'s n is not a count of its requests")
        cpu = args.get("cpu_us")
        if cpu is not None and not (_num(cpu) and cpu >= 0):
            raise _bad(p, f"event {i}'s cpu_us is not a CPU time")
        spans.append(Span(name, float(ts), float(ts) + float(dur), tuple(reqs), src, n,
                          None if cpu is None else float(cpu)))
    spans.sort(key=lambda s: s.start_us)
    return label, host, spans


Traces = dict[int, tuple[str, str | None, list[Span]]]  # rank -> (label, host, spans), as read_trace gives them


def read_traces(trace_dir: str | Path) -> Traces:
    """Every rank's trace file in ``trace_dir`` (:func:`read_trace`), by rank."""
    d = Path(trace_dir)
    files = sorted((int(m.group(1)), f) for f in d.glob("rank*.json") if (m := _RANK_FILE.fullmatch(f.name)))
    if not files:
        raise HpcsplitError(f"no rank<r>.json trace files in {d}; run stage=bench (or serve) with "
                            "runtime.trace.start_step=N runtime.trace.end_step=M, then pass its run folder")
    return {rank: read_trace(f) for rank, f in files}


def trace_hops(trace_dir: str | Path, traces: Traces | None = None) -> tuple[list[Hop], dict[int, str], list[str]]:
    """Every hop of the traced requests (see the module's docstring), the ranks' labels, and notes (edges
    left out, spans whose request lists the tracer cut); ``traces``: the folder's files, already read."""
    labels: dict[int, str] = {}
    hosts: dict[int, str | None] = {}
    spans: dict[int, list[Span]] = {}
    cut = 0
    for rank, (label, host, ss) in (traces if traces is not None else read_traces(trace_dir)).items():
        labels[rank], hosts[rank] = label, host
        spans[rank] = [x for x in ss if x.name in _WORK]
        cut += sum(x.n > len(x.requests) for x in spans[rank])
    sends: dict[tuple[int, int], Span] = {}  # (rank, request) -> its first send span holding the request
    for rank, ss in spans.items():
        for x in ss:
            if x.name in _SEND:
                for q in x.requests:
                    sends.setdefault((rank, q), x)
    hops: list[Hop] = []
    cross: set[tuple[int, int]] = set()
    for dst, ss in spans.items():
        starts = [x.start_us for x in ss]
        ends = list(itertools.accumulate((x.end_us for x in ss), max))  # busy until, over the spans so far
        for k, x in enumerate(ss):
            if x.name not in _RECV or x.src is None:
                continue
            if hosts.get(x.src) != hosts[dst] and x.src in hosts:
                cross.add((x.src, dst))
                continue
            for q in x.requests:
                snd = sends.get((x.src, q))
                if snd is None or snd.start_us > x.start_us:
                    continue
                before = bisect.bisect_left(starts, snd.start_us, 0, k)  # the receiver's spans begun before the send
                if before == 0:
                    continue  # its first traced span: how long it had been idle is not known
                idle_since, busy_until = ends[before - 1], ends[k - 1]  # (before <= k: k >= 1 here)
                ready = max(snd.start_us, busy_until)
                hops.append(Hop(x.src, dst, q, (x.start_us - ready) / 1e3, max(0.0, snd.start_us - idle_since) / 1e3,
                                max(0.0, busy_until - snd.start_us) / 1e3))
    notes = [f"edge {a} -> {b} left out: the ranks run on different hosts ({hosts[a]}, {hosts[b]}), whose clocks "
             "differ" for a, b in sorted(cross)]
    if cut:
        notes.append(f"{cut} span(s) name only the first 64 of their requests (the tracer keeps 64): the hops of the "
                     "others are not read")
    return hops, labels, notes


def span_rows(trace_dir: str | Path, keep: set[int] | None = None, traces: Traces | None = None) -> list[dict[str, Any]]:
    """Per rank and kind of span that carries its CPU (``cpu_us``: sends and compute), medians of its wall time,
    its thread's CPU and the difference, the time the rank waited inside the span (for a core, mostly, where
    one-thread CPU ranks share a node's cores; on a GPU, or with torch's other threads, compute is not the thread's
    CPU); spans of the requests in ``keep`` only, when given (microseconds); ``traces``: the folder's files, already
    read."""
    rows = []
    for rank, (label, _, spans) in (traces if traces is not None else read_traces(trace_dir)).items():
        by: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for x in spans:
            if x.cpu_us is not None and (keep is None or any(q in keep for q in x.requests)):
                by[x.name].append((x.end_us - x.start_us, x.cpu_us))
        for name, v in sorted(by.items()):
            a = np.array(v)
            rows.append({"rank": rank, "label": label, "span": name, "n": len(v),
                         "wall_p50_us": float(np.median(a[:, 0])), "cpu_p50_us": float(np.median(a[:, 1])),
                         "waited_p50_us": float(np.median(np.maximum(0.0, a[:, 0] - a[:, 1]))),
                         "waited_p90_us": float(np.quantile(np.maximum(0.0, a[:, 0] - a[:, 1]), 0.9))})
    return rows


def _span_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'rank':<28} {'span':<11} {'n':>6} {'wall p50':>9} {'CPU p50':>8} {'waited p50':>10} {'p90':>8}   (us)"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['label'][:28]:<28} {r['span']:<11} {r['n']:>6} {r['wall_p50_us']:>9.1f} "
                     f"{r['cpu_p50_us']:>8.1f} {r['waited_p50_us']:>10.1f} {r['waited_p90_us']:>8.1f}")
    return "\n".join(lines)


def bench_requests(run_dir: str | Path, variant: str, qps: float | None = None) -> set[int]:
    """The request ids of one variant (and level) of the bench run in ``run_dir`` (``bench/requests.h5``)."""
    import h5py

    path = Path(run_dir) / "bench" / "requests.h5"
    if not path.is_file():
        raise HpcsplitError(f"--variant needs the bench's requests ({path} is not there); pass the run folder of a "
                            "stage=bench run")
    ids: set[int] = set()
    try:
        with h5py.File(path, "r") as f:
            g = f.get(variant)
            if not isinstance(g, h5py.Group):
                raise HpcsplitError(f"{path} has no variant {variant!r} (it has {sorted(f)})")
            levels = sorted(k for k in g if k.startswith("qps_") and isinstance(g.get(k), h5py.Group))
            want = levels if qps is None else [k for k in levels if math.isclose(_level(k), qps, rel_tol=1e-6)]
            if not want:
                at = "level" if qps is None else f"level at {qps:g} req/s"
                raise HpcsplitError(f"{path}: {variant} has no {at} (it has {', '.join(k[4:] for k in levels) or 'none'})")
            for k in want:
                d = g[k].get("request_ids")
                if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype.kind not in "iu" or d.size > 1 << 26:
                    raise HpcsplitError(f"{path}: {variant}/{k}/request_ids is not a list of request ids")
                ids.update(int(x) for x in d[()])
    except (OSError, KeyError) as e:
        raise HpcsplitError(f"cannot read {path} as the bench's HDF5 requests: {e}") from e
    return ids


def _level(key: str) -> float:
    try:
        return float(key[4:])
    except ValueError:
        return math.nan


SIM_PARTS = ("way", "busy", "hop", "core")  # simulated_ways' figures per edge


def simulated_ways(sim: list[tuple[int, int, float, float, int, float, float, float]]
                   ) -> dict[tuple[int, int], dict[str, float]]:
    """Per edge, medians (ms) of the simulated messages' send-to-taken times (``way``) and of its parts: the wait
    for the receiver's work (``busy``), the hop delay of a sleeping receiver (``hop``) and the wait for a core
    (``core``; :func:`~hpcsplit.core.simulator.simulate`'s ``hops``), and the way's p90 (``way_p90``), each message
    counted once per request."""
    by: dict[tuple[int, int], list[tuple[float, ...]]] = defaultdict(list)
    for a, b, sent, taken, n, dlv, busy, hop in sim:
        core = max(0.0, taken - dlv - busy - hop)
        by[(a, b)] += [((taken - sent) * 1e3, busy * 1e3, hop * 1e3, core * 1e3)] * max(1, n)
    return {k: {**dict(zip(SIM_PARTS, np.median(np.array(v), axis=0).tolist(), strict=True)),
                "way_p90": float(np.quantile(np.array(v)[:, 0], 0.9))} for k, v in by.items()}


def edge_rows(hops: list[Hop], labels: dict[int, str], cal: Calibration | None,
              sim: dict[tuple[int, int], dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """One row per edge: requests, medians of gap, busy and hop, the hop's p90, the calibrated hop's median and,
    with ``sim`` (:func:`simulated_ways`), the measured and simulated medians of send to taken (busy + hop), the
    simulated way's parts (its waits for the receiver's work, its hop delay, its wait for a core) and the measured
    and simulated p90s of the way (the tails a p99 is made of)."""
    by: dict[tuple[int, int], list[Hop]] = defaultdict(list)
    for h in hops:
        by[(h.src, h.dst)].append(h)
    rows = []
    for (a, b), hs in sorted(by.items()):
        hop = np.array([h.hop_ms for h in hs])
        gap = np.array([h.gap_ms for h in hs])
        row: dict[str, Any] = {"src": a, "dst": b, "edge": f"{labels.get(a, a)} -> {labels.get(b, b)}",
                               "requests": len(hs), "gap_p50_ms": float(np.median(gap)),
                               "busy_p50_ms": float(np.median([h.busy_ms for h in hs])),
                               "hop_p50_ms": float(np.median(hop)), "hop_p90_ms": float(np.quantile(hop, 0.9))}
        if cal is not None:
            c = float(np.median([cal.hop.at(g) for g in gap]))
            row["calibrated_p50_ms"] = c
            row["measured_over_calibrated"] = row["hop_p50_ms"] / c if c > 0 else math.nan
        if sim is not None:
            way = [h.busy_ms + h.hop_ms for h in hs]
            row["way_p50_ms"] = float(np.median(way))
            got = sim.get((a, b), {})
            for part in SIM_PARTS:
                row[f"simulated_{part}_p50_ms"] = got.get(part, math.nan)
            row["way_p90_ms"] = float(np.quantile(way, 0.9))
            row["simulated_way_p90_ms"] = got.get("way_p90", math.nan)
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]], cal: bool) -> str:
    sim = bool(rows) and "simulated_way_p50_ms" in rows[0]
    head = f"{'edge':<34} {'n':>6} {'gap p50':>9} {'busy p50':>8} {'hop p50':>8} {'hop p90':>8}"
    head += f" {'calib.':>8} {'meas/cal':>8}" if cal else ""
    head += (f" {'way':>7} {'sim way':>7} {'sim/way':>7} {'s.busy':>7} {'s.hop':>7} {'s.core':>7} {'way p90':>7}"
             f" {'sim p90':>7}") if sim else ""
    lines = [head + "   (ms)", "-" * len(head)]
    for r in rows:
        line = (f"{r['edge'][:34]:<34} {r['requests']:>6} {r['gap_p50_ms']:>9.3f} {r['busy_p50_ms']:>8.3f} "
                f"{r['hop_p50_ms']:>8.3f} {r['hop_p90_ms']:>8.3f}")
        if cal:
            line += f" {r['calibrated_p50_ms']:>8.3f} {r['measured_over_calibrated']:>7.2f}x"
        if sim:
            w, sw = r["way_p50_ms"], r["simulated_way_p50_ms"]
            line += f" {w:>7.3f} {sw:>7.3f} {sw / w if w > 0 else math.nan:>6.2f}x"
            line += "".join(f" {r[f'simulated_{k}_p50_ms']:>7.3f}" for k in SIM_PARTS[1:])
            line += f" {r['way_p90_ms']:>7.3f} {r['simulated_way_p90_ms']:>7.3f}"
        lines.append(line)
    tot, busy = sum(r["hop_p50_ms"] for r in rows), sum(r["busy_p50_ms"] for r in rows)
    last = f"{'sum over the edges':<34} {'':>6} {'':>9} {busy:>8.3f} {tot:>8.3f} {'':>8}"
    if cal:
        tc = sum(r["calibrated_p50_ms"] for r in rows)
        last += f" {tc:>8.3f} {tot / tc if tc > 0 else math.nan:>7.2f}x"
    if sim:  # (an edge the simulation never used counts 0 in its sum)
        tw, ts = sum(r["way_p50_ms"] for r in rows), float(np.nansum([r["simulated_way_p50_ms"] for r in rows]))
        last += f" {tw:>7.3f} {ts:>7.3f} {ts / tw if tw > 0 else math.nan:>6.2f}x"
        last += "".join(f" {float(np.nansum([r[f'simulated_{k}_p50_ms'] for r in rows])):>7.3f}" for k in SIM_PARTS[1:])
    lines.append(last)
    return "\n".join(lines)


def _plot(hops: list[Hop], cal: Calibration | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gap = np.array([max(h.gap_ms, 1e-3) for h in hops])
    ax.scatter(gap, [h.hop_ms for h in hops], s=6, alpha=0.4, label="measured hops (traced)")
    if cal is not None:
        g = np.logspace(-3, math.log10(max(gap.max(), 1.0) * 1.2), 200)
        ax.plot(g, [cal.hop.at(x) for x in g], color="C3", label="calibrated hop (calibration.json)")
    ax.set_xscale("log")
    ax.set_xlabel("receiver idle before the message (ms; none drawn at 0.001)")
    ax.set_ylabel("hop: send start to message taken (ms)")
    ax.set_title("Hops of a traced run against the calibration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bench_cfg(run: Path) -> dict[str, Any] | str:
    """The bench's configuration (``bench.cfg.json``), or why it cannot be read."""
    try:
        cfg = json.loads((run / "bench.cfg.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        return str(e)
    return cfg if isinstance(cfg, dict) else "not a configuration (a JSON object)"


def _run_calibration(run: Path, cfg: dict[str, Any] | str) -> str | None:
    """The calibration a bench run used: the one its configuration names (relative to the run folder when not
    absolute), else the run folder's own ``calibration.json``; None when neither is there."""
    named = cfg.get("calibration") if isinstance(cfg, dict) else None
    for c in ([run / named] if isinstance(named, str) else []) + [run / "calibration.json"]:
        if c.is_file():  # an absolute name stays itself under ``run /``
            return str(c)
    return None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcsplit.bench hops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run folder with trace/rank<r>.json (or the trace folder itself)")
    ap.add_argument("--calibration", help="calibration.json to compare with (default: the one the run's "
                                          "bench.cfg.json names, else the run folder's, when there)")
    ap.add_argument("--variant", choices=("whole", "split"), help="only this variant's requests of a bench run")
    ap.add_argument("--qps", type=float, help="with --variant: only this level's requests")
    ap.add_argument("--simulate", action="store_true",
                    help="with --variant and --qps: simulate that level of the bench (its plan, profile, schedule "
                         "and seed, under the calibration) and set each edge's simulated send-to-taken time beside "
                         "the measured one (busy + hop)")
    ap.add_argument("--out", help="where hops.csv and hops.png go (default: the trace folder)")
    args = ap.parse_args(argv)
    try:
        run = Path(args.run_dir)
        trace_dir = run / "trace" if (run / "trace").is_dir() else run
        cfg = _bench_cfg(run)
        cal_path = args.calibration or _run_calibration(run, cfg)
        cal = load_calibration(cal_path) if cal_path else None
        traces = read_traces(trace_dir)
        hops, labels, notes = trace_hops(trace_dir, traces)
        what, keep = "", None
        if args.variant:
            keep = bench_requests(run, args.variant, args.qps)
            hops = [h for h in hops if h.request in keep]
            what = f", {args.variant}" + (f" at {args.qps:g} req/s" if args.qps is not None else "")
        elif args.qps is not None:
            raise HpcsplitError("--qps picks a level of a variant: give --variant too")
        if not hops:
            raise HpcsplitError(f"the traces in {trace_dir} hold no hop with both ends traced; trace a window of "
                                "requests (runtime.trace.start_step / end_step) that the ranks served")
        sim = None
        if args.simulate:
            if not (args.variant and args.qps is not None and cal is not None):
                raise HpcsplitError("--simulate needs --variant, --qps and a calibration (--calibration PATH, or "
                                    "one the run's bench.cfg.json names)")
            if not isinstance(cfg, dict):
                raise HpcsplitError(f"--simulate needs the bench's configuration {run / 'bench.cfg.json'}: {cfg}")
            sim = simulated_ways(simulated_hops(cfg, run, cal, args.variant, args.qps))
        rows = edge_rows(hops, labels, cal, sim)
        print(f"# hops of the traced requests in {trace_dir}{what} ({len({h.request for h in hops})} requests)"
              + (f", against {cal_path}" if cal else ""))
        print(_table(rows, cal is not None))
        for n in notes:
            print(n)
        print("gap: the receiver idle when the send started; busy: the receiver still working after it; hop: from "
              "the later of the two to the message taken; calib.: the calibration's hop at each hop's gap (the "
              "simulator's charge before any wait for a core)"
              + ("; way: busy + hop, measured; sim way: the simulated send to taken, and its parts: s.busy the wait "
                 "for the receiver's work, s.hop the hop delay of a sleeping receiver, s.core the wait for a core "
                 "(medians: the parts need not add up to the way); way p90, sim p90: the way's p90, measured and "
                 "simulated" if sim else ""))
        spans = span_rows(trace_dir, keep, traces)
        if spans:
            print(f"\n# the ranks' own spans{what}: wall time against the thread's CPU (waited: inside the span, not "
                  "on the CPU; for a core, mostly, where one-thread CPU ranks share cores; a GPU's work and torch's "
                  "other threads are not the thread's CPU)")
            print(_span_table(spans))
        out = Path(args.out) if args.out else trace_dir
        try:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "hops.csv", "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            _plot(hops, cal, out / "hops.png")
            if spans:
                with open(out / "spans.csv", "w", newline="") as fh:
                    w = csv.DictWriter(fh, fieldnames=list(spans[0]))
                    w.writeheader()
                    w.writerows(spans)
        except OSError as e:
            raise HpcsplitError(f"cannot write hops.csv and hops.png to {out}: {e.strerror or e}; pass --out DIR "
                                "somewhere writable") from e
        print(f"wrote {out / 'hops.csv'}{', ' + str(out / 'spans.csv') if spans else ''} and {out / 'hops.png'}")
    except HpcsplitError as e:
        print(f"error: {e}")
        return 2
    return 0
