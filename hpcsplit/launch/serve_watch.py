"""The login side of ``stage=serve runtime.mode=server``: wait for the job's ``endpoint.json``, print how to
reach the server, then a status line every ``runtime.server_status_s``; start the job again when it ended
after serving.

:class:`ServeWatch` runs as a daemon thread beside the launcher's own wait (local mpiexec or the SLURM job),
which owns the job: Ctrl-C there stops it (SIGTERM to mpiexec, or ``scancel``), and the server drains and
exits 0 (``[Note: server mode]`` in :mod:`hpcsplit.runtime.server.serve`).  Reads the run folder and asks the
server's ``/metrics`` with the token: no torch, no aiohttp.  Over TLS (``runtime.tls_cert``) the token
goes only to a server that presents that very certificate (pinned: the node's address need not be a
name in it, and no CA store is needed).

[Note: server restarts]
:func:`serve_with_restarts` runs the job again when it ended after serving: its summary says a component
lost its last replica (``restart``, ``[Note: serving through faults]`` in
:mod:`hpcsplit.runtime.server.failover`), or it failed after its endpoint was up (rank 0 died, a node was
lost: the MPI world could not go on).  A job that never served, one stopped on purpose (a stop signal:
it drains and ends cleanly) and one past its time limit (:class:`~hpcsplit.errors.JobTimedOut`) are not
started again.  At most ``launcher.restarts`` restarts in a row (a job that served for
:data:`RESTART_RESET_S` resets the count), after ``launcher.restart_backoff_s`` doubling to
:data:`MAX_BACKOFF_S`.  The next job listens on the same ports (``runtime.server_port_fallback``: free ones
if the host has them taken) and requires the same token (``runtime.server_token_file``, the run folder's
own ``server.token``, which a job that is to be restarted keeps), and writes ``endpoint.json`` again.
Under ``launcher=slurm`` a restart is a new job: first :func:`restart_on_cluster` checks that the
partition still has the nodes the plan needs; a CPU plan is folded onto the nodes left, otherwise the
login side says why the job cannot start again.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.errors import JobTimedOut, LaunchError
from hpcsplit.launch.keeper import server_faults
from hpcsplit.launch.slurm import _run
from hpcsplit.launch.stages import cluster_spec

__all__ = ["MAX_BACKOFF_S", "RESTART_RESET_S", "ServeWatch", "connection_lines", "fetch_pinned", "parse_metrics", "restart_config",
           "restart_on_cluster", "serve_with_restarts"]

RESTART_RESET_S = 3600.0  # a job that served this long starts the count of restarts in a row afresh
MAX_BACKOFF_S = 60.0


def connection_lines(ep: dict[str, Any], login_host: str | None = None) -> list[str]:
    """What to print once the server is ready: URLs, the token file, an ``ssh -L`` line.

    Examples
    --------
    >>> print("\\n".join(connection_lines({"host": "n1", "http_port": 8000, "grpc_port": 8001, "model": "m",
    ...                                     "token_file": "/r/server.token"}, "login1")))
    [hpcsplit] server ready: model 'm' at http://n1:8000 (HTTP, v2 protocol) and n1:8001 (gRPC)
    [hpcsplit] token: /r/server.token (send 'Authorization: Bearer <token>')
    [hpcsplit] from your machine: ssh -N -L 8000:n1:8000 -L 8001:n1:8001 login1   (then http://localhost:8000)
    """
    host, hp, gp = ep["host"], ep["http_port"], ep["grpc_port"]
    login = login_host or socket.getfqdn()
    tok = ep.get("token_file")
    tls = ep.get("tls") is True
    scheme = "https" if tls else "http"
    return [
        (f"[hpcsplit] server ready: model {ep['model']!r} at {scheme}://{host}:{hp} (HTTP, v2 protocol) and {host}:{gp} "
        f"(gRPC{', TLS' if tls else ''})"),
        f"[hpcsplit] token: {tok} (send 'Authorization: Bearer <token>')" if tok else "[hpcsplit] no token required",
        (f"[hpcsplit] from your machine: ssh -N -L {hp}:{host}:{hp} -L {gp}:{host}:{gp} {login}   "
         f"(then {scheme}://localhost:{hp})"),
    ]


def parse_metrics(text: str) -> dict[str, Any]:
    """The figures of a status line from the server's Prometheus text: answered / failed requests, the
    latency histogram's cumulative buckets (summed over protocols) and the queue depth.

    Examples
    --------
    >>> m = parse_metrics('hpcsplit_requests_total{outcome="ok",protocol="http"} 3.0\\n'
    ...                   'hpcsplit_request_latency_seconds_bucket{le="0.01",protocol="http"} 2.0\\n'
    ...                   'hpcsplit_queue_depth 1.0\\n')
    >>> m["ok"], m["buckets"], m["queue"]
    (3.0, {0.01: 2.0}, 1.0)
    """
    out: dict[str, Any] = {"ok": 0.0, "failed": 0.0, "buckets": {}, "queue": 0.0, "lost": 0.0}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, val = line.rsplit(" ", 1)
        v = float(val)
        if key.startswith("hpcsplit_requests_total"):
            out["ok" if 'outcome="ok"' in key else "failed"] += v
        elif key.startswith("hpcsplit_request_latency_seconds_bucket"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            b = math.inf if le == "+Inf" else float(le)
            out["buckets"][b] = out["buckets"].get(b, 0.0) + v
        elif key.startswith("hpcsplit_queue_depth"):
            out["queue"] = v
        elif key.startswith("hpcsplit_replica_lost{"):  # [Note: serving through faults]
            out["lost"] += v
    return out


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """The bucket bound that holds quantile ``q`` of a cumulative histogram (None when it is empty)."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    want = q * items[-1][1]
    return next(b for b, c in items if c >= want)


class ServeWatch:
    """The thread (see the module docstring); :meth:`stop` ends it."""

    def __init__(self, paths: RunPaths, echo: Callable[[str], None], status_s: float, progress_s: float = 10.0,
                 tls_cert: str | None = None, after: float = 0.0) -> None:
        self.paths, self.echo = paths, echo
        self.tls_cert = tls_cert
        self.status_s, self.progress_s = status_s, progress_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpcsplit-serve-watch", daemon=True)
        self.endpoint: dict[str, Any] | None = None
        self.ready_at: float | None = None  # time.monotonic() when this job's endpoint.json appeared
        self.after = after  # an endpoint.json started at or before this (an earlier job's, left behind) is not this job's
        self.token: str | None = None  # the job's token, read once it is ready (the next job requires the same)

    def start(self) -> ServeWatch:
        # an endpoint.json left by an earlier job in this folder is not this job's
        self._t_start = time.time()
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)

    def _read_endpoint(self) -> dict[str, Any] | None:
        p = self.paths.server_endpoint
        try:
            ep = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            return None
        # written by the job, read here as any file: values checked before they reach a URL or a print
        if not isinstance(ep, dict):
            return None
        started, host, model = ep.get("started", 0), ep.get("host"), ep.get("model")
        ports = [ep.get("http_port"), ep.get("grpc_port")]
        if (not isinstance(started, int | float) or started < self._t_start - 5 or started <= self.after
                or not isinstance(host, str) or not 0 < len(host) <= 255 or any(c in host for c in "/@?# ")
                or not isinstance(model, str)
                or not all(isinstance(q, int) and not isinstance(q, bool) and 0 < q < 65536 for q in ports)):
            return None
        return ep

    def _run(self) -> None:
        t0 = time.monotonic()
        last = t0
        while not self._stop.is_set():
            ep = self._read_endpoint()
            if ep is not None:
                self.endpoint, self.ready_at = ep, time.monotonic()
                break
            if time.monotonic() - last >= self.progress_s:
                last = time.monotonic()
                self.echo(f"[hpcsplit] waiting for the server: {last - t0:.0f} s (ranks loading, checking the "
                          f"outputs; {self.paths.server_endpoint} appears once it is ready)")
            self._stop.wait(0.5)
        if self.endpoint is None:
            return
        for line in connection_lines(self.endpoint):
            self.echo(line)
        tok = None
        if self.endpoint.get("token_file"):  # this run folder's own token file, not a path the JSON names
            try:
                tok = Path(self.paths.server_token).read_text().strip()
            except OSError:
                tok = None
        self.token = tok
        host, port = self.endpoint["host"], int(self.endpoint["http_port"])
        tls = self.tls_cert is not None or self.endpoint.get("tls") is True
        url = f"{'https' if tls else 'http'}://{host}:{port}/metrics"
        prev: dict[str, Any] | None = None
        while not self._stop.wait(self.status_s):
            if not Path(self.paths.server_endpoint).exists():  # the server removes it when it stops
                self.echo("[hpcsplit] server stopped (endpoint.json removed); waiting for the job to end")
                return
            try:
                if tls:
                    text = fetch_pinned(host, port, "/metrics", tok, self.tls_cert)
                else:
                    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {tok}"} if tok else {})
                    with urllib.request.urlopen(req, timeout=5) as r:
                        text = r.read()
                m = parse_metrics(text.decode())
            except (OSError, ValueError, ssl.SSLError, http.client.HTTPException) as e:
                self.echo(f"[hpcsplit] server status: no answer from {url} ({e})")
                continue
            self.echo(status_line(m, prev, self.status_s))
            prev = m


def fetch_pinned(host: str, port: int, path: str, token: str | None, cert_file: str | None,
                 timeout_s: float = 5.0) -> bytes:
    """GET ``path`` over TLS from a server that presents the first certificate of ``cert_file`` (PEM), and
    only then send the token; raises OSError (or ssl.SSLError) otherwise."""
    if not cert_file:
        raise OSError("the server uses TLS and runtime.tls_cert is not known here")
    pem = Path(cert_file).read_text()
    end = "-----END CERTIFICATE-----"
    if end not in pem:
        raise ValueError(f"{cert_file} holds no PEM certificate")
    want = ssl.PEM_cert_to_DER_cert(pem[pem.index("-----BEGIN CERTIFICATE-----"):pem.index(end) + len(end)])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the pin below is the check: this exact certificate, nothing else
    conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ctx)
    try:
        conn.connect()
        if not isinstance(conn.sock, ssl.SSLSocket) or conn.sock.getpeercert(binary_form=True) != want:
            raise ssl.SSLError(f"the server at {host}:{port} presents another certificate than {cert_file}")
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        if r.status != 200:
            raise OSError(f"HTTP {r.status}")
        return r.read()
    finally:
        conn.close()


def status_line(m: dict[str, Any], prev: dict[str, Any] | None, interval_s: float) -> str:
    """``requests 120 (+40, 4.0/s), failed 0, p50 <= 5 ms, p99 <= 20 ms (last interval), queue 0``."""
    d_ok = m["ok"] - (prev["ok"] if prev else 0.0)
    b = m["buckets"]
    if prev:
        b = {k: v - prev["buckets"].get(k, 0.0) for k, v in b.items()}
    p50, p99 = _quantile(b, 0.5), _quantile(b, 0.99)

    def ms(x: float | None) -> str:
        return "-" if x is None else (">60 s" if math.isinf(x) else f"<= {x * 1e3:g} ms")

    lost = m.get("lost", 0.0)
    return (f"[hpcsplit] server status: requests {m['ok']:.0f} (+{d_ok:.0f}, {d_ok / interval_s:.1f}/s), failed "
            f"{m['failed']:.0f}, p50 {ms(p50)}, p99 {ms(p99)} (last {interval_s:g} s), queue {m['queue']:.0f}"
            + (f", degraded: {lost:.0f} replica(s) lost" if lost else ""))


# ------------------------------------------------------------------------------------------ restarts
def _restart_reason(result: Any, err: LaunchError | None, served: bool) -> str | None:
    """Why the job that just ended is started again (``[Note: server restarts]``); None: it is not."""
    if err is not None:
        return (str(err).strip().splitlines() or ["it failed"])[0][:500] if served else None
    faults = server_faults(result)
    return faults["restart"] if faults else None


def _write_token(path: Path, token: str) -> None:
    """``token`` into ``path`` (the run folder's ``server.token``), readable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def restart_config(cfg: dict[str, Any], endpoint: dict[str, Any] | None, paths: RunPaths) -> dict[str, Any]:
    """The config of the next job: the same ports (free ones if the host has them taken) and the same token.

    Examples
    --------
    >>> rc = restart_config({"runtime": {"server_http_port": 0, "server_grpc_port": 0}},
    ...                     {"http_port": 8000, "grpc_port": 8001}, RunPaths.from_config({}, "/nonexistent"))
    >>> rc["runtime"]["server_http_port"], rc["runtime"]["server_port_fallback"], rc["runtime"].get("server_token_file")
    (8000, True, None)
    """
    new = json.loads(json.dumps(cfg))
    rt = new.setdefault("runtime", {})
    if endpoint is not None:
        free = False
        for key, port in (("server_http_port", "http_port"), ("server_grpc_port", "grpc_port")):
            if not rt.get(key) and isinstance(endpoint.get(port), int):
                rt[key], free = endpoint[port], True
        if free:  # the first job chose them: the next one takes free ones when these are taken
            rt["server_port_fallback"] = True
    if rt.get("server_token", True) and not rt.get("server_token_file") and paths.server_token.is_file():
        rt["server_token_file"] = str(paths.server_token)
    return new


def serve_with_restarts(run: Callable[[dict[str, Any]], Any], cfg: dict[str, Any], paths: RunPaths,
                        echo: Callable[[str], None], status_s: float, restarts: int, backoff_s: float,
                        tls_cert: str | None = None,
                        prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Any:
    """Run a server job (``run(cfg)``: rank 0's result, or :class:`LaunchError`) with :class:`ServeWatch`, and
    start it again while ``[Note: server restarts]`` says so; the last job's result.  ``prepare`` (SLURM:
    :func:`restart_on_cluster`) gives the next job's config, or raises :class:`LaunchError` saying why there
    is none."""
    in_a_row, delay = 0, backoff_s
    last_started = 0.0
    while True:
        watch = ServeWatch(paths, echo, status_s, tls_cert=tls_cert, after=last_started).start()
        result, err = None, None
        try:
            result = run(cfg)
        except JobTimedOut:
            raise
        except LaunchError as e:
            err = e
        finally:
            watch.stop()
        why = _restart_reason(result, err, watch.endpoint is not None)
        if why is None:
            if err is not None:
                raise err
            return result
        if watch.ready_at is not None and time.monotonic() - watch.ready_at >= RESTART_RESET_S:
            in_a_row, delay = 0, backoff_s
        if in_a_row >= restarts:
            raise LaunchError(f"the server job ended after serving ({why}); launcher.restarts={restarts} restarts in "
                              "a row are used up, so it is not started again. The log says what went wrong") from err
        echo(f"[hpcsplit] the server job ended after serving: {why}")
        try:
            cfg = prepare(cfg) if prepare is not None else cfg
        except LaunchError as e:
            raise LaunchError(f"the server job ended after serving ({why}); it cannot be started again: {e}") from err
        in_a_row += 1
        if watch.endpoint is not None:
            last_started = float(watch.endpoint["started"])
        if watch.token and not paths.server_token.exists():  # a job stopped by its scheduler removed it
            _write_token(paths.server_token, watch.token)
        # the ports: the job's own word (a short-lived job may end before the watch saw its endpoint.json)
        said = server_faults(result)
        cfg = restart_config(cfg, said if said and isinstance(said.get("http_port"), int) else watch.endpoint, paths)
        rt = cfg.get("runtime") or {}
        echo(f"[hpcsplit] starting the server job again in {delay:g} s (restart {in_a_row} of {restarts} in a row; "
             f"ports {rt.get('server_http_port')} and {rt.get('server_grpc_port')}"
             + (", the same token)" if rt.get("server_token_file") else ")"))
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


def restart_on_cluster(cfg: dict[str, Any], run_dir: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """The config of the next server job on the SLURM partition as it is now (``[Note: server restarts]``).

    When the plan needs more nodes than the partition has taking jobs (a node down, drained or not
    responding), a CPU plan is folded onto the nodes left (``<run>/plan.restart.json``: the ranks of node
    ``i`` of ``n`` go to node ``i * k // n`` of the ``k`` left, in order, and share its cores); a GPU plan
    cannot be (its GPUs and slices are those of the nodes it was made for).

    Raises
    ------
    LaunchError
        Why the job cannot start again: which nodes are down, and what to do.
    """
    paths = RunPaths.from_config(cfg, run_dir)
    if not paths.plan.is_file():
        return cfg
    plan = Plan.load(paths.plan)
    slurm = cluster_spec(cfg).slurm
    part = ["-p", slurm.partition] if slurm is not None and slurm.partition else []
    out = _run(["sinfo", "-h", "-N", *part, "-o", "%N|%T|%E"])
    if out is None:
        return cfg  # no answer: try (the job then waits in the queue or fails on its own)
    up: set[str] = set()
    down: set[str] = set()
    for line in out.splitlines():
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        if state.rstrip("~#") in ("idle", "mixed", "allocated", "completing"):  # '*': not responding
            up.add(node)
        else:
            down.add(f"{node} {state}" + (f" ({reason})" if reason and reason != "none" else ""))
    if len(up) >= plan.nodes:
        return cfg
    where = (f"the plan needs {plan.nodes} node(s) and the partition has {len(up)} that take jobs"
             + (f" (down: {'; '.join(sorted(down))})" if down else ""))
    if plan.device_kind != "cpu" or not up:
        raise LaunchError(f"{where}; bring the node back (scontrol update nodename=NODE state=resume), or allocate a "
                          "plan for the nodes left and serve it")
    k = len(up)
    folded = replace(plan, nodes=k, ranks=tuple(replace(r, node=r.node * k // plan.nodes) for r in plan.ranks),
                     utilization={}, meta={**plan.meta, "folded_from_nodes": plan.nodes})
    path = paths.run_dir / "plan.restart.json"
    folded.save(path)
    echo(f"[hpcsplit] {where}: the next job runs the plan's ranks on {k} node(s) ({path}: the ranks of the lost "
         "node(s) share the cores of those left)")
    return {**cfg, "plan": str(path)}
