"""The serve and bench stages' settings (``conf/runtime/default.yaml``, ``conf/bench/default.yaml``) as
frozen dataclasses (``[Note: settings]`` in :mod:`hpcsplit.core.settings`).

Imports neither torch nor mpi4py, so the login side checks them before any rank starts
(:mod:`hpcsplit.launch.config`) and :mod:`hpcsplit.runtime.stage` reads them on the ranks.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from hpcsplit.core.load import ARRIVALS
from hpcsplit.core.settings import Checker, group_defaults
from hpcsplit.errors import ConfigError

__all__ = ["SETTINGS", "BenchSettings", "FaultSettings", "RuntimeSettings", "TraceSettings", "stage_settings"]


Mode = Literal["batch", "bench", "server"]


def _over_defaults(group: str, given: Any, nullable: frozenset[str]) -> Any:
    """``given`` (the config's node of ``group``) over ``conf/<group>/default.yaml``.

    A config composed by Hydra holds every key; callers without Hydra (tests, a hand-written
    ``CFG.json``) may give only some.  A null for a key that cannot be null means its default, as before.
    """
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        return given  # the Checker reports it
    merged = group_defaults(group)
    for key, v in given.items():
        if v is None and key not in nullable and merged.get(key) is not None:
            continue
        merged[key] = v
    return merged


# ------------------------------------------------------------------------------------------- runtime
@dataclass(frozen=True, slots=True)
class TraceSettings:
    """``runtime.trace``: Chrome-trace the requests with ``start_step <= id < end_step`` (both set)."""

    start_step: int | None
    end_step: int | None

    @classmethod
    def from_mapping(cls, values: Any, c: Checker) -> TraceSettings:
        """Read the ``trace`` block; problems go to ``c`` (the runtime's checker)."""
        keys = tuple(f.name for f in fields(cls))
        t = Checker("runtime.trace", values, keys)
        out = cls(start_step=t.integer("start_step", lo=0, none=True, default=None),
                  end_step=t.integer("end_step", lo=0, none=True, default=None))
        c.problems.extend(t.problems)
        return out


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """``runtime.fault`` (tests only): make component ``component`` raise, or sleep ``sleep_s`` on ``times``
    batches, after ``after_batches`` batches; ``nan``: raise on every batch whose inputs hold a NaN (a bad
    sample: batch mode fails only its rows)."""

    component: str
    kind: Literal["raise", "sleep", "nan"]
    after_batches: int
    sleep_s: float
    times: int

    @classmethod
    def from_mapping(cls, values: Any, c: Checker) -> FaultSettings | None:
        if values is None:
            return None
        keys = tuple(f.name for f in fields(cls))
        f = Checker("runtime.fault", values, keys)
        out = cls(component=f.string("component"),
                  kind=f.choice("kind", ("raise", "sleep", "nan"), default="raise"),
                  after_batches=f.integer("after_batches", lo=0, default=0),
                  sleep_s=f.number("sleep_s", lo=0, default=1.0),
                  times=f.integer("times", lo=0, default=1))
        c.problems.extend(f.problems)
        return out


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """The serve runtime's settings (``conf/runtime/default.yaml``; its comments say what each does).

    ``mode`` is resolved: ``runtime.mode`` null means the stage's (``bench`` -> bench, else batch).
    """

    mode: Mode
    max_wait_ms: float
    max_inflight: int
    request_timeout_s: float
    threads: int | None
    omp_wait_policy: str | None
    trace: TraceSettings
    input_path: str | None
    output_path: str | None
    num_samples: int
    verify: bool
    verify_atol: float
    verify_rtol: float
    abort_grace_s: float
    fault: FaultSettings | None
    idle_sleep_ms: float
    spin_us: float | None  # polls back to back this long after work (None: by mode, mailbox.spin_after_work_s)
    doorbell: bool | Literal["local"]
    doorbell_network: str | None
    stop_grace_s: float
    load_timeout_s: float
    overwrite: bool
    chunk_rows: int | None  # batch mode: rows read per input chunk (None: about 32 MiB of inputs)
    max_failures: int | None  # batch mode: stop the job once more rows than this failed (None: never)
    progress_s: float  # batch mode: a progress line this often
    server_host: str | None  # server mode: the address to listen on (None: this node's own)
    server_http_port: int
    server_grpc_port: int
    server_token: bool
    server_max_body_mb: float
    server_queue: int
    server_max_batch: int
    server_drain_s: float
    server_status_s: float
    server_model: Literal["split", "whole"]
    server_workers: int | None  # protocol worker processes (None: one per spare core of the frontend's node)
    tls_cert: str | None  # server mode: PEM certificate chain (with tls_key: HTTPS and gRPC over TLS)
    tls_key: str | None
    server_token_file: str | None  # server mode: require the token in this file (None: a new one per job)
    server_port_fallback: bool  # server mode: when the given ports are taken, listen on free ones
    silence_s: float  # server mode: a replica heard nothing from this long is lost ([Note: serving through faults])

    _NULLABLE = frozenset({"mode", "threads", "omp_wait_policy", "trace", "input_path", "output_path", "fault",
                           "doorbell_network", "chunk_rows", "max_failures", "spin_us",
                           "server_host", "server_workers", "tls_cert", "tls_key", "server_token_file"})

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RuntimeSettings:
        """Read ``cfg["runtime"]`` (and ``cfg["stage"]`` for the mode); one ConfigError lists every problem.

        Examples
        --------
        >>> rt = RuntimeSettings.from_config({"stage": "bench", "runtime": {"max_wait_ms": 1}})
        >>> rt.mode, rt.max_wait_ms, rt.trace
        ('bench', 1.0, TraceSettings(start_step=None, end_step=None))
        >>> RuntimeSettings.from_config({"runtime": {"max_infligth": 3}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hpcsplit.errors.ConfigError: invalid runtime settings:
          - runtime.max_infligth is not a setting (did you mean 'max_inflight'?); valid: ...
        """
        values = _over_defaults("runtime", cfg.get("runtime"), cls._NULLABLE)
        keys = tuple(f.name for f in fields(cls))
        c = Checker("runtime", values, keys)
        mode = c.choice("mode", (None, "batch", "bench", "server"))
        if mode is None:
            mode = "bench" if cfg.get("stage") == "bench" else "batch"
        policy = c.string("omp_wait_policy", none=True)
        if policy is not None and policy.upper() not in ("PASSIVE", "ACTIVE"):
            c.problem(f"runtime.omp_wait_policy = {policy!r}: needs PASSIVE, ACTIVE or null (OpenMP's default)")
        doorbell = c.get("doorbell")
        if not (type(doorbell) is bool or doorbell == "local"):
            c.problem(f"runtime.doorbell = {doorbell!r}: use true (ring ranks on every node), local "
                      "(ranks on the same node only) or false")
            doorbell = False
        net = c.get("doorbell_network")
        if net is not None:
            try:
                if not isinstance(net, str) or not net.strip():
                    raise ValueError("not a string")
                if "/" in net:
                    ipaddress.IPv4Network(net, strict=False)
            except ValueError as e:
                c.problem(f"runtime.doorbell_network = {net!r}: give an interface name (hsn0, ib0) or an IPv4 "
                          f"network such as 10.100.0.0/16 ({e})")
                net = None
        trace_values = c.get("trace")
        out = cls(
            mode=mode,
            max_wait_ms=c.number("max_wait_ms", lo=0),
            max_inflight=c.integer("max_inflight", lo=1),
            request_timeout_s=c.number("request_timeout_s", lo=0, lo_open=True),
            threads=c.integer("threads", lo=1, hi=1024, none=True),  # null: chosen, see [Note: rank threads]
            omp_wait_policy=policy.upper() if policy else None,
            trace=TraceSettings.from_mapping(trace_values, c),
            input_path=c.string("input_path", none=True),
            output_path=c.string("output_path", none=True),
            num_samples=c.integer("num_samples", lo=1),
            verify=c.boolean("verify"),
            verify_atol=c.number("verify_atol", lo=0),
            verify_rtol=c.number("verify_rtol", lo=0),
            abort_grace_s=c.number("abort_grace_s", lo=0),
            fault=FaultSettings.from_mapping(c.get("fault"), c),
            idle_sleep_ms=c.number("idle_sleep_ms", lo=0),
            spin_us=c.number("spin_us", lo=0, hi=1e6, none=True),
            doorbell=doorbell,
            doorbell_network=net,
            stop_grace_s=c.number("stop_grace_s", lo=0),
            load_timeout_s=c.number("load_timeout_s", lo=0, lo_open=True),
            overwrite=c.boolean("overwrite"),
            chunk_rows=c.integer("chunk_rows", lo=1, none=True),
            max_failures=c.integer("max_failures", lo=0, none=True),
            progress_s=c.number("progress_s", lo=0, lo_open=True),
            server_host=c.string("server_host", none=True),
            server_http_port=c.integer("server_http_port", lo=0, hi=65535),
            server_grpc_port=c.integer("server_grpc_port", lo=0, hi=65535),
            server_token=c.boolean("server_token"),
            server_max_body_mb=c.number("server_max_body_mb", lo=0, lo_open=True),
            server_queue=c.integer("server_queue", lo=1),
            server_max_batch=c.integer("server_max_batch", lo=1),
            server_drain_s=c.number("server_drain_s", lo=0),
            server_status_s=c.number("server_status_s", lo=0, lo_open=True),
            server_model=c.choice("server_model", ("split", "whole")),
            server_workers=c.integer("server_workers", lo=0, hi=256, none=True),
            tls_cert=c.string("tls_cert", none=True),
            tls_key=c.string("tls_key", none=True),
            server_token_file=c.string("server_token_file", none=True),
            server_port_fallback=c.boolean("server_port_fallback"),
            silence_s=c.number("silence_s", lo=0.5),
        )
        if (out.tls_cert is None) != (out.tls_key is None):
            c.problem(f"runtime.tls_cert = {out.tls_cert!r} and runtime.tls_key = {out.tls_key!r}: give both (the "
                      "server's PEM certificate chain and its private key) or neither (no TLS)")
        c.done()
        return out

    @property
    def wait_bound_s(self) -> float:
        """How long rank 0 waits for a rank at STOP, the counters and the barriers after serving:
        ``request_timeout_s + stop_grace_s`` (``[Note: every wait has a deadline]`` in
        :mod:`hpcsplit.runtime.faults`).

        Examples
        --------
        >>> RuntimeSettings.from_config({"runtime": {"request_timeout_s": 5, "stop_grace_s": 2}}).wait_bound_s
        7.0
        """
        return self.request_timeout_s + self.stop_grace_s

    @property
    def heartbeat_s(self) -> float:
        """How often a rank of a server says it is alive when it has nothing else to send: a fifth of
        ``silence_s`` (``[Note: serving through faults]`` in :mod:`hpcsplit.runtime.server.failover`).

        Examples
        --------
        >>> RuntimeSettings.from_config({"runtime": {"silence_s": 5}}).heartbeat_s
        1.0
        """
        return self.silence_s / 5


# --------------------------------------------------------------------------------------------- bench
@dataclass(frozen=True, slots=True)
class BenchSettings:
    """The split-vs-whole benchmark's settings (``conf/bench/default.yaml``)."""

    qps: tuple[float, ...]
    duration_s: float
    min_requests: int
    floor_runs: int
    arrival: Literal["poisson", "constant", "bursty"]
    warmup_s: float
    seed: int
    request_timeout_s: float | None  # None: runtime.request_timeout_s
    input_pool: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> BenchSettings:
        """Read ``cfg["bench"]``; one ConfigError lists every problem.

        Examples
        --------
        >>> BenchSettings.from_config({"bench": {"qps": 5, "duration_s": 2}}).qps
        (5.0,)
        >>> BenchSettings.from_config({"bench": {"qps": [-1, 2]}})
        Traceback (most recent call last):
        ...
        hpcsplit.errors.ConfigError: invalid bench settings:
          - bench.qps = [-1, 2]: needs a non-empty list of numbers > 0
        """
        values = _over_defaults("bench", cfg.get("bench"), frozenset({"request_timeout_s"}))
        keys = tuple(f.name for f in fields(cls))
        c = Checker("bench", values, keys)
        raw = c.get("qps")
        items = raw if isinstance(raw, list | tuple) else [raw]
        if not items or any(isinstance(q, bool) or not isinstance(q, int | float) or not q > 0 for q in items):
            c.problem(f"bench.qps = {raw!r}: needs a non-empty list of numbers > 0")
            items = []
        out = cls(
            qps=tuple(float(q) for q in items),
            duration_s=c.number("duration_s", lo=0, lo_open=True),
            min_requests=c.integer("min_requests", lo=0),
            floor_runs=c.integer("floor_runs", lo=0),
            arrival=c.choice("arrival", ARRIVALS),
            warmup_s=c.number("warmup_s", lo=0),
            seed=c.integer("seed"),
            request_timeout_s=c.number("request_timeout_s", lo=0, lo_open=True, none=True),
            input_pool=c.integer("input_pool", lo=1),
        )
        c.done()
        return out


SETTINGS: dict[str, type] = {"runtime": RuntimeSettings, "bench": BenchSettings}


def stage_settings(cfg: Mapping[str, Any]) -> tuple[RuntimeSettings, BenchSettings]:
    """Both groups' settings; one ConfigError lists the problems of both."""
    out: list[Any] = []
    errors: list[str] = []
    for cls in (RuntimeSettings, BenchSettings):
        try:
            out.append(cls.from_config(cfg))
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))
    return out[0], out[1]
