"""The calibration file (``calibration.json``): what the target machine's runtime costs, measured there.

[Note: calibration contract]
``stage=calibrate`` (:mod:`hpcsplit.launch.calibrate`) measures, with the runtime's own frontend, component
loop and transport on the nodes of the cluster preset, the figures below and writes them as one JSON
object with ``format: "hpcsplit-calibration"`` and ``schema_version``.  Three readers use it: the export's
benefit-vs-cost split rule (:meth:`Calibration.split_rule`), the allocator (the frontend's CPU per request in
the CPU time-sharing pass) and the simulator (:mod:`hpcsplit.core.simulator`).  Without a file each uses
:meth:`Calibration.defaults` (the development VM's constants, the figures ``conf/partition/dominator.yaml``
documents) and says so (``source == "defaults"``).

- ``hop``: the delay of one hop to a rank that has been idle for ``gap`` ms (wake-up, doorbell, cold
  caches and the message itself; CPU work of the hop excluded), a :class:`Curve` over idle gaps; ``hop_p90``
  the same at the 90th percentile (the simulator's jitter; since ``[Note: hop spread]`` the hop's spread pooled
  over every gap, so one gap's outlier does not make it);
- ``frontend_timer``: from a request's arrival to its admission, for a frontend asleep ``gap`` ms;
- ``compute_cold``: extra compute of a small program run after ``gap`` ms idle (against back to back);
- ``idle_cpu`` (optional; zero when absent): CPU ms a rank spends while idle ``gap`` ms between two
  messages, its spin after work included: the runtime's backoff wakes it to poll (20 us doubling, then the
  doorbell), and each wake-up costs a context switch and a poll; on a node whose cores are shared these
  take time from the ranks that compute (``[Note: idle CPU]`` in :mod:`hpcsplit.core.simulator`);
- ``same_node`` / ``cross_node`` (:class:`Link`): one-way latency of a small message between two busy
  ranks and bandwidth, from the runtime's transport at several sizes (``cross_node`` null on one node);
  ``cross_extra``: what a hop to an idle rank on another node adds to the same-node ``hop`` (a UDP ring);
- ``cpu``: CPU microseconds the frontend spends per request and per message, and a component per
  message and per request, measured at saturation;
- ``compute``: GFLOP/s of a fixed matmul set per thread count, and ``corun_slowdown[k-1]``: how much
  slower each of ``k`` ranks computing at once on one node runs than one alone;
- ``programs`` (optional): per exported program of one switchboard (``switchboard_sha256``), its batch-1
  time back to back, its extra time after idle gaps, and (optional, 0 when absent) the extra of a rank's turn
  with it after the core's caches were evicted (:class:`ProgramCal`); ``cpu.evicted_us_per_turn`` (optional)
  the same for a turn that only takes and sends a small message, and ``cpu.evicted_us_per_wake`` (optional) for
  an idle rank's wake-up that finds nothing, in CPU time (``[Note: evicted caches]`` in
  :mod:`hpcsplit.launch.calibrate_run`);
- ``wake_on_ringer_core`` (optional; null or absent: not measured): the share of doorbell wake-ups that ran on the
  core of the rank that rang (``[Note: stacked wake-ups]`` in :mod:`hpcsplit.launch.calibrate_run`); a figure for
  people (it says whether to bind ranks to cores), not yet read by the simulator.

The file is untrusted input: :func:`load_calibration` reads at most 1 MiB of JSON (no code, nothing outside
the file), checks every key and value and raises :class:`~hpcsplit.errors.CalibrationError` naming every
problem, what was needed and what to do; a file of another kind (a plan, a profile, any JSON) is refused
by its ``format``.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcsplit.errors import CalibrationError

__all__ = [
    "CALIBRATION_FORMAT",
    "CALIBRATION_SCHEMA_VERSION",
    "HOP_SPREAD_MAX",
    "Calibration",
    "Curve",
    "Link",
    "ProgramCal",
    "calibration_for",
    "load_calibration",
]

CALIBRATION_FORMAT = "hpcsplit-calibration"
CALIBRATION_SCHEMA_VERSION = 1
MAX_CALIBRATION_BYTES = 1 << 20
MAX_POINTS = 64  # points of one curve or size sweep
MAX_MS = 3.6e6  # an hour: no measured delay is larger
MAX_PROGRAMS = 4096
HOP_SPREAD_MAX = 4.0  # a hop's p90 over its p50 at most, as fitted and as simulated ([Note: hop spread])

# The documented defaults (docs/simulate.md): the development VM's figures, also conf/partition/dominator.yaml's.
DEFAULT_HOP_MS = 0.3  # a message to a rank asleep 10 ms: 260-349 us of Python (docs/runtime.md)
DEFAULT_GB_S = 0.5  # the runtime's in-flight estimate (runtime/transport.py)
DEFAULT_GFLOPS = 30.0  # ViT-B/32's vision tower, ~4.4 GFLOP a sample, in 139 ms on one core
DEFAULT_FRONTEND_US_PER_REQUEST = 200.0  # the frontend ceiling is 5,000-8,000 req/s on one core
DEFAULT_MESSAGE_US = 20.0  # a rank's per-message Python back to back (docs/runtime.md)
SPLIT_RULE_GAP_MS = 10.0  # the split rule's hop: a message to a rank asleep this long


@dataclass(frozen=True, slots=True)
class Curve:
    """A delay (ms) against an idle gap (ms): linear in log(1 + gap) between the points, flat outside.

    Examples
    --------
    >>> c = Curve((0.0, 10.0, 1000.0), (0.05, 0.3, 0.6))
    >>> c.at(0.0), c.at(10.0), round(c.at(100.0), 3), c.at(1e6)
    (0.05, 0.3, 0.447, 0.6)
    >>> Curve.constant(0.3).at(42.0)
    0.3
    """

    gaps_ms: tuple[float, ...]
    values_ms: tuple[float, ...]
    _x: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_x", tuple(math.log1p(g) for g in self.gaps_ms))

    @classmethod
    def constant(cls, value_ms: float) -> Curve:
        return cls((0.0,), (float(value_ms),))

    def at(self, gap_ms: float) -> float:
        x, v = self._x, self.values_ms
        if len(v) == 1 or gap_ms <= self.gaps_ms[0]:
            return v[0]
        lx = math.log1p(gap_ms)
        i = bisect.bisect_right(x, lx)
        if i >= len(x):
            return v[-1]
        f = (lx - x[i - 1]) / (x[i] - x[i - 1])
        return v[i - 1] + f * (v[i] - v[i - 1])

    def to_json(self) -> dict[str, list[float]]:
        return {"gaps_ms": list(self.gaps_ms), "values_ms": list(self.values_ms)}


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of hop: one-way latency of a small message between busy ranks, and bandwidth."""

    latency_ms: float
    gb_s: float
    sizes_bytes: tuple[int, ...] = ()  # the measured points (what the fit came from)
    one_way_ms: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"latency_ms": self.latency_ms, "gb_s": self.gb_s, "sizes_bytes": list(self.sizes_bytes),
                "one_way_ms": list(self.one_way_ms)}


@dataclass(frozen=True, slots=True)
class ProgramCal:
    """One exported program (a component or ``whole``): batch-1 ms back to back, extra ms after idle gaps, and the
    extra ms of a rank's whole turn with it (receive, program, send) after its core's caches were evicted."""

    batch1_ms: float
    cold: Curve
    evicted_ms: float = 0.0  # (files written before it have none: 0)

    def to_json(self) -> dict[str, Any]:
        return {"batch1_ms": self.batch1_ms, "cold": self.cold.to_json(), "evicted_ms": self.evicted_ms}


@dataclass(frozen=True, slots=True)
class Calibration:
    """The target's runtime costs (``[Note: calibration contract]``)."""

    source: str  # "measured" or "defaults"
    created_utc: str
    hpcsplit_version: str
    cluster: str
    hosts: tuple[str, ...]
    nodes: int
    cores_per_node: int
    device_kind: str
    hop: Curve
    hop_p90: Curve
    frontend_timer: Curve
    compute_cold: Curve
    same_node: Link
    cross_node: Link | None
    cross_extra: Curve  # per hop to an idle rank on another node, beyond the same-node hop, against the gap
    frontend_us_per_request: float
    frontend_us_per_message: float
    component_us_per_message: float
    component_us_per_request: float
    compute_gflops: dict[int, float]  # threads -> GFLOP/s of the matmul set
    corun_slowdown: tuple[float, ...]  # [k-1]: slowdown of each of k ranks computing at once on a node
    switchboard_sha256: str | None = None  # whose programs ``programs`` holds
    programs: dict[str, ProgramCal] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    idle_cpu: Curve = field(default_factory=lambda: Curve.constant(0.0))  # CPU ms of an idle gap, its spin included
    frontend_us_per_turn: float = 0.0  # CPU of a frontend loop pass that does work, beyond its requests and messages
    evicted_us_per_turn: float = 0.0  # extra CPU of a messaging turn after the core's caches were evicted
    evicted_us_per_wake: float = 0.0  # ... of an idle rank's wake-up that finds nothing ([Note: idle CPU])
    wake_on_ringer_core: float | None = None  # share of doorbell wake-ups run on the ringer's core ([Note: stacked
    # wake-ups] in launch/calibrate_run.py); None: not measured

    # ------------------------------------------------------------------ the readers' figures
    @classmethod
    def defaults(cls) -> Calibration:
        """The documented defaults (the development VM), used when no calibration file is given."""
        hop = Curve.constant(DEFAULT_HOP_MS)
        return cls(
            source="defaults", created_utc="", hpcsplit_version="", cluster="", hosts=(), nodes=1,
            cores_per_node=0, device_kind="cpu", hop=hop, hop_p90=hop, frontend_timer=Curve.constant(0.0),
            compute_cold=Curve.constant(0.0), same_node=Link(0.0, DEFAULT_GB_S), cross_node=None,
            cross_extra=Curve.constant(0.0), frontend_us_per_request=DEFAULT_FRONTEND_US_PER_REQUEST, frontend_us_per_message=0.0,
            component_us_per_message=DEFAULT_MESSAGE_US, component_us_per_request=0.0,
            compute_gflops={1: DEFAULT_GFLOPS}, corun_slowdown=(1.0,),
        )

    @property
    def measured(self) -> bool:
        return self.source == "measured"

    def gflops(self, threads: int = 1) -> float:
        """GFLOP/s of the matmul set at ``threads`` (the closest measured count)."""
        k = min(self.compute_gflops, key=lambda t: (abs(t - threads), t))
        return self.compute_gflops[k]

    def split_rule(self) -> dict[str, float]:
        """``compute_gflops``, ``transport_gb_s``, ``hop_ms`` for the export's benefit-vs-cost rule.

        The hop is a message to a rank asleep :data:`SPLIT_RULE_GAP_MS`, as the default's figure was measured.
        """
        return {"compute_gflops": self.gflops(1), "transport_gb_s": self.same_node.gb_s,
                "hop_ms": self.hop.at(SPLIT_RULE_GAP_MS)}

    def link(self, cross: bool) -> Link:
        return self.cross_node if cross and self.cross_node is not None else self.same_node

    def corun(self, k: int) -> float:
        """Slowdown of each of ``k`` ranks computing at once on one node (1 for ``k <= 1``)."""
        if k <= 1:
            return 1.0
        s = self.corun_slowdown
        return s[min(k, len(s)) - 1]

    def program(self, name: str, switchboard_sha256: str | None) -> ProgramCal | None:
        """The measured program ``name`` of that switchboard, if this calibration has it."""
        if not self.programs or switchboard_sha256 is None or switchboard_sha256 != self.switchboard_sha256:
            return None
        return self.programs.get(name)

    def with_hop_scaled(self, factor: float) -> Calibration:
        """The same calibration with every hop delay ``factor`` times longer (what-if studies, tests)."""
        def sc(c: Curve) -> Curve:
            return Curve(c.gaps_ms, tuple(v * factor for v in c.values_ms))
        return replace(self, hop=sc(self.hop), hop_p90=sc(self.hop_p90))

    def origin(self) -> str:
        """Where the figures come from, for logs and tables."""
        if self.measured:
            return f"calibration of {self.cluster or '?'} ({', '.join(self.hosts[:4]) or '?'}, {self.created_utc})"
        return "the documented defaults (no calibration file: run stage=calibrate)"

    def describe(self) -> str:
        """One line: where the constants come from and the main figures."""
        r = self.split_rule()
        return (f"constants from {self.origin()}: hop {r['hop_ms']:.3g} ms to a rank idle {SPLIT_RULE_GAP_MS:g} ms, "
                f"{r['transport_gb_s']:.3g} GB/s, {r['compute_gflops']:.3g} GFLOP/s, frontend "
                f"{self.frontend_us_per_request:.0f} us/request")

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "schema_version": CALIBRATION_SCHEMA_VERSION,
            "source": self.source,
            "created_utc": self.created_utc,
            "hpcsplit_version": self.hpcsplit_version,
            "cluster": self.cluster,
            "hosts": list(self.hosts),
            "nodes": self.nodes,
            "cores_per_node": self.cores_per_node,
            "device_kind": self.device_kind,
            "hop": self.hop.to_json(),
            "hop_p90": self.hop_p90.to_json(),
            "frontend_timer": self.frontend_timer.to_json(),
            "compute_cold": self.compute_cold.to_json(),
            "idle_cpu": self.idle_cpu.to_json(),
            "same_node": self.same_node.to_json(),
            "cross_node": None if self.cross_node is None else self.cross_node.to_json(),
            "cross_extra": self.cross_extra.to_json(),
            "cpu": {"frontend_us_per_request": self.frontend_us_per_request,
                    "frontend_us_per_message": self.frontend_us_per_message,
                    "frontend_us_per_turn": self.frontend_us_per_turn,
                    "evicted_us_per_turn": self.evicted_us_per_turn,
                    "evicted_us_per_wake": self.evicted_us_per_wake,
                    "component_us_per_message": self.component_us_per_message,
                    "component_us_per_request": self.component_us_per_request},
            "compute": {"gflops": {str(k): v for k, v in sorted(self.compute_gflops.items())},
                        "corun_slowdown": list(self.corun_slowdown)},
            "programs": None if not self.programs else {
                "switchboard_sha256": self.switchboard_sha256,
                "programs": {k: v.to_json() for k, v in self.programs.items()}},
            "notes": list(self.notes),
            "wake_on_ringer_core": self.wake_on_ringer_core,
        }

    def save(self, path: str | Path) -> Path:
        """Write the JSON (validated by reading it back: a writer bug never leaves a file readers refuse)."""
        p = Path(path)
        text = json.dumps(self.to_json(), indent=2) + "\n"
        parse_calibration(text.encode(), p)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(p)
        return p


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------------------------------------- reading
def calibration_for(path: str | Path, given: bool) -> Calibration:
    """The calibration a stage uses: the file given (``calibration=PATH``: it must exist and be valid), else the
    run folder's ``calibration.json`` when there is one, else :meth:`Calibration.defaults` (``source ==
    "defaults"``; callers say so: :meth:`Calibration.describe`).

    >>> calibration_for("/nonexistent/calibration.json", given=False).source
    'defaults'
    """
    p = Path(path)
    if given or p.exists():
        return load_calibration(p)
    return Calibration.defaults()


def load_calibration(path: str | Path) -> Calibration:
    """Read and check ``calibration.json``.

    Raises
    ------
    CalibrationError
        Naming the file and every problem: not JSON, too large, another kind of file, another schema
        version, a missing or unknown key, a value of the wrong type or out of range.
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_CALIBRATION_BYTES + 1)
    except OSError as e:
        raise CalibrationError(f"cannot read calibration file {p}: {e.strerror or e}; run stage=calibrate "
                               "or pass calibration=PATH of an existing calibration.json") from e
    return parse_calibration(data, p)


def parse_calibration(data: bytes, path: Path) -> Calibration:
    """:func:`load_calibration` on bytes already read (``path`` names them in messages)."""
    redo = "re-run `python -m hpcsplit stage=calibrate` (it writes calibration.json) and pass calibration=PATH"
    if len(data) > MAX_CALIBRATION_BYTES:
        raise CalibrationError(f"{path}: larger than {MAX_CALIBRATION_BYTES} bytes; a calibration file is a few "
                               f"KiB of JSON. Needed: a calibration.json; {redo}")
    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # (ValueError: also an integer of more than 4300 digits)
        raise CalibrationError(f"{path}: not a JSON calibration file ({e}); {redo}") from e
    except RecursionError:
        raise CalibrationError(f"{path}: nests JSON too deeply to be a calibration file; {redo}") from None
    if not isinstance(d, dict):
        raise CalibrationError(f"{path}: found a JSON {type(d).__name__}; needed an object with "
                               f"format={CALIBRATION_FORMAT!r}; {redo}")
    fmt = d.get("format")
    if fmt != CALIBRATION_FORMAT:
        kind = ("a plan" if "ranks" in d else "a switchboard layout" if "components" in d and "edges" in d
                else "a profile" if fmt == "hpcsplit-profile" else "another kind of file")
        raise CalibrationError(f"{path}: found format={fmt!r} ({kind}); needed format={CALIBRATION_FORMAT!r}: "
                               f"this is not a calibration file; {redo}")
    ver = d.get("schema_version")
    if ver != CALIBRATION_SCHEMA_VERSION:
        raise CalibrationError(f"{path}: found schema_version={ver!r}; this hpcsplit reads version "
                               f"{CALIBRATION_SCHEMA_VERSION}; {redo} with this hpcsplit")
    r = _Reader(path, absent=[k for k in _Reader.KEYS if k not in d])
    cal = r.calibration(d)
    r.done(redo)
    assert cal is not None
    return cal


class _Reader:
    """Collects every problem of one file; values are checked as they are read."""

    KEYS = ("format", "schema_version", "source", "created_utc", "hpcsplit_version", "cluster", "hosts", "nodes",
            "cores_per_node", "device_kind", "hop", "hop_p90", "frontend_timer", "compute_cold", "same_node",
            "cross_node", "cross_extra", "cpu", "compute", "programs", "notes", "idle_cpu", "wake_on_ringer_core")
    # added within schema version 1: files written before them have none (zero, or not measured, then)
    OPTIONAL = ("idle_cpu", "wake_on_ringer_core")

    def __init__(self, path: Path, absent: Sequence[str] = ()) -> None:
        self.path = path
        self.problems: list[str] = []
        self.absent = set(absent)  # top-level keys the file lacks: reported once, as missing

    def done(self, redo: str) -> None:
        if self.problems:
            raise CalibrationError(f"invalid calibration file {self.path}:\n  - " + "\n  - ".join(self.problems[:40])
                                   + f"\n{redo}")

    def bad(self, what: str, v: Any, need: str) -> None:
        text = repr(v)
        self.problems.append(f"{what} = {text if len(text) < 80 else text[:77] + '...'}: needs {need}")

    def keys(self, d: Any, what: str, keys: Sequence[str], optional: Sequence[str] = ()) -> Mapping[str, Any]:
        if not isinstance(d, Mapping):
            if what not in self.absent:  # a missing top-level key is reported once, above (null is wrong here)
                self.bad(what, d, "an object")
            return {}
        missing = [k for k in keys if k not in d and k not in optional]
        extra = [str(k) for k in d if k not in keys]
        if missing:
            self.problems.append(f"{what}: missing keys {missing}")
        if extra:
            self.problems.append(f"{what}: unknown keys {extra} (valid: {list(keys)})")
        return d

    def num(self, v: Any, what: str, lo: float = 0.0, hi: float = MAX_MS, lo_open: bool = False) -> float:
        # (an integer beyond a float's range is refused as out of range, not converted: math.isfinite would raise)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))
        if not ok or not (lo < v if lo_open else lo <= v) or v > hi:
            self.bad(what, v, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
            return max(lo, 1e-9) if lo_open else lo
        return float(v)

    def whole(self, v: Any, what: str, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            self.bad(what, v, f"an integer in [{lo}, {hi}]")
            return lo
        return int(v)

    def text(self, v: Any, what: str, limit: int = 256) -> str:
        if not isinstance(v, str) or len(v) > limit:
            self.bad(what, v, f"a string of at most {limit} characters")
            return ""
        return v

    def curve(self, d: Any, what: str) -> Curve:
        d = self.keys(d, what, ("gaps_ms", "values_ms"))
        if not d:
            return Curve.constant(0.0)
        gaps, vals = d.get("gaps_ms"), d.get("values_ms")
        if not (isinstance(gaps, list) and isinstance(vals, list) and 1 <= len(gaps) == len(vals) <= MAX_POINTS):
            self.bad(what, d, f"gaps_ms and values_ms: lists of equal length 1..{MAX_POINTS}")
            return Curve.constant(0.0)
        g = [self.num(x, f"{what}.gaps_ms[{i}]") for i, x in enumerate(gaps)]
        v = [self.num(x, f"{what}.values_ms[{i}]") for i, x in enumerate(vals)]
        if any(b <= a for a, b in itertools.pairwise(g)):
            self.bad(f"{what}.gaps_ms", gaps, "strictly increasing gaps")
            return Curve.constant(0.0)
        return Curve(tuple(g), tuple(v))

    def link(self, d: Any, what: str) -> Link:
        d = self.keys(d, what, ("latency_ms", "gb_s", "sizes_bytes", "one_way_ms"))
        if not d:
            return Link(0.0, DEFAULT_GB_S)
        sizes, ms = d.get("sizes_bytes", []), d.get("one_way_ms", [])
        if not (isinstance(sizes, list) and isinstance(ms, list) and len(sizes) == len(ms) <= MAX_POINTS):
            self.bad(what, d, f"sizes_bytes and one_way_ms: lists of equal length at most {MAX_POINTS}")
            sizes, ms = [], []
        return Link(self.num(d.get("latency_ms"), f"{what}.latency_ms"),
                    self.num(d.get("gb_s"), f"{what}.gb_s", 0.0, 1e5, lo_open=True),
                    tuple(self.whole(x, f"{what}.sizes_bytes[{i}]", 0, 1 << 40) for i, x in enumerate(sizes)),
                    tuple(self.num(x, f"{what}.one_way_ms[{i}]") for i, x in enumerate(ms)))

    def calibration(self, d: Mapping[str, Any]) -> Calibration | None:
        d = self.keys(d, "calibration", self.KEYS, optional=self.OPTIONAL)
        source = d.get("source")
        if source not in ("measured", "defaults"):
            self.bad("source", source, "'measured' or 'defaults'")
        hosts = d.get("hosts")
        if not isinstance(hosts, list) or len(hosts) > 1 << 16:
            self.bad("hosts", hosts, "a list of host names")
            hosts = []
        kind = d.get("device_kind")
        if kind not in ("cpu", "cuda"):
            self.bad("device_kind", kind, "'cpu' or 'cuda'")
        cpu = self.keys(d.get("cpu"), "cpu", ("frontend_us_per_request", "frontend_us_per_message",
                                              "frontend_us_per_turn", "evicted_us_per_turn", "evicted_us_per_wake",
                                              "component_us_per_message", "component_us_per_request"),
                        optional=("frontend_us_per_turn", "evicted_us_per_turn",
                                  "evicted_us_per_wake"))  # (older files have none: 0)
        comp = self.keys(d.get("compute"), "compute", ("gflops", "corun_slowdown"))
        gfl = comp.get("gflops")
        gflops: dict[int, float] = {}
        if not isinstance(gfl, Mapping) or not 1 <= len(gfl) <= MAX_POINTS:
            self.bad("compute.gflops", gfl, f"an object thread count -> GFLOP/s (1..{MAX_POINTS} entries)")
        else:
            for k, v in gfl.items():
                if not (isinstance(k, str) and k.isascii() and k.isdigit() and 1 <= int(k) <= 1024):
                    self.bad("compute.gflops key", k, "a thread count '1'..'1024'")
                    continue
                gflops[int(k)] = self.num(v, f"compute.gflops[{k}]", 0.0, 1e9, lo_open=True)
        co = comp.get("corun_slowdown")
        if not isinstance(co, list) or not 1 <= len(co) <= 1024:
            self.bad("compute.corun_slowdown", co, "a list of 1..1024 slowdowns (>= 1 each)")
            co = [1.0]
        corun = tuple(self.num(x, f"compute.corun_slowdown[{i}]", 1.0, 1e3) for i, x in enumerate(co))
        progs: dict[str, ProgramCal] = {}
        sha = None
        pd = d.get("programs")
        if pd is not None:
            pd = self.keys(pd, "programs", ("switchboard_sha256", "programs"))
            sha = self.text(pd.get("switchboard_sha256"), "programs.switchboard_sha256", 64)
            items = pd.get("programs")
            if not isinstance(items, Mapping) or len(items) > MAX_PROGRAMS:
                self.bad("programs.programs", items, f"an object name -> program figures (at most {MAX_PROGRAMS})")
                items = {}
            for name, pv in items.items():
                w = f"programs[{name!r}]"
                pv = self.keys(pv, w, ("batch1_ms", "cold", "evicted_ms"), optional=("evicted_ms",))
                progs[self.text(name, f"{w} name")] = ProgramCal(
                    self.num(pv.get("batch1_ms"), f"{w}.batch1_ms"), self.curve(pv.get("cold"), f"{w}.cold"),
                    self.num(pv["evicted_ms"], f"{w}.evicted_ms") if "evicted_ms" in pv else 0.0)
        notes = d.get("notes", [])
        if not isinstance(notes, list) or len(notes) > 100:
            self.bad("notes", notes, "a list of at most 100 strings")
            notes = []
        cross = d.get("cross_node")
        cal = Calibration(
            source=str(source),
            created_utc=self.text(d.get("created_utc"), "created_utc", 64),
            hpcsplit_version=self.text(d.get("hpcsplit_version"), "hpcsplit_version", 64),
            cluster=self.text(d.get("cluster"), "cluster"),
            hosts=tuple(self.text(h, f"hosts[{i}]") for i, h in enumerate(hosts)),
            nodes=self.whole(d.get("nodes"), "nodes", 1, 1 << 16),
            cores_per_node=self.whole(d.get("cores_per_node"), "cores_per_node", 0, 1 << 16),
            device_kind=str(kind),
            hop=self.curve(d.get("hop"), "hop"),
            hop_p90=self.curve(d.get("hop_p90"), "hop_p90"),
            frontend_timer=self.curve(d.get("frontend_timer"), "frontend_timer"),
            compute_cold=self.curve(d.get("compute_cold"), "compute_cold"),
            same_node=self.link(d.get("same_node"), "same_node"),
            cross_node=None if cross is None else self.link(cross, "cross_node"),
            cross_extra=self.curve(d.get("cross_extra"), "cross_extra"),
            frontend_us_per_request=self.num(cpu.get("frontend_us_per_request"), "cpu.frontend_us_per_request", 0, 1e6),
            frontend_us_per_message=self.num(cpu.get("frontend_us_per_message"), "cpu.frontend_us_per_message", 0, 1e6),
            component_us_per_message=self.num(cpu.get("component_us_per_message"), "cpu.component_us_per_message",
                                              0, 1e6),
            component_us_per_request=self.num(cpu.get("component_us_per_request"), "cpu.component_us_per_request",
                                              0, 1e6),
            compute_gflops=gflops or {1: DEFAULT_GFLOPS},
            corun_slowdown=corun,
            switchboard_sha256=sha or None,
            programs=progs,
            notes=tuple(self.text(n, f"notes[{i}]", 2000) for i, n in enumerate(notes)),
            idle_cpu=self.curve(d["idle_cpu"], "idle_cpu") if "idle_cpu" in d else Curve.constant(0.0),
            frontend_us_per_turn=(self.num(cpu["frontend_us_per_turn"], "cpu.frontend_us_per_turn", 0, 1e6)
                                  if "frontend_us_per_turn" in cpu else 0.0),
            evicted_us_per_turn=(self.num(cpu["evicted_us_per_turn"], "cpu.evicted_us_per_turn", 0, 1e6)
                                 if "evicted_us_per_turn" in cpu else 0.0),
            evicted_us_per_wake=(self.num(cpu["evicted_us_per_wake"], "cpu.evicted_us_per_wake", 0, 1e6)
                                 if "evicted_us_per_wake" in cpu else 0.0),
            wake_on_ringer_core=(None if d.get("wake_on_ringer_core") is None
                                 else self.num(d["wake_on_ringer_core"], "wake_on_ringer_core", 0, 1)),
        )
        return cal
