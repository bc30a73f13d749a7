"""The login side of ``stage=serve runtime.mode=server``: wait for the job's ``endpoint.json``, print how to
reach the server, then a status line every ``runtime.server_status_s``.

Runs as a daemon thread beside the launcher's own wait (local mpiexec or the SLURM job), which owns the
job: Ctrl-C there stops it (SIGTERM to mpiexec, or ``scancel``), and the server drains and exits 0
(``[Note: server mode]`` in :mod:`hpcsplit.runtime.server.serve`).  Reads the run folder and asks the
server's ``/metrics`` with the token: no torch, no aiohttp.  Over TLS (``runtime.tls_cert``) the token
goes only to a server that presents that very certificate (pinned: the node's address need not be a
name in it, and no CA store is needed).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcsplit.core.paths import RunPaths

__all__ = ["ServeWatch", "connection_lines", "fetch_pinned", "parse_metrics"]


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
    out: dict[str, Any] = {"ok": 0.0, "failed": 0.0, "buckets": {}, "queue": 0.0}
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
                 tls_cert: str | None = None) -> None:
        self.paths, self.echo = paths, echo
        self.tls_cert = tls_cert
        self.status_s, self.progress_s = status_s, progress_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpcsplit-serve-watch", daemon=True)
        self.endpoint: dict[str, Any] | None = None

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
        if (not isinstance(started, int | float) or started < self._t_start - 5
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
                self.endpoint = ep
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

    return (f"[hpcsplit] server status: requests {m['ok']:.0f} (+{d_ok:.0f}, {d_ok / interval_s:.1f}/s), failed "
            f"{m['failed']:.0f}, p50 {ms(p50)}, p99 {ms(p99)} (last {interval_s:g} s), queue {m['queue']:.0f}")
