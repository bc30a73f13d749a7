"""Server benchmark: hpcsplit's Open Inference Protocol endpoint vs a bare echo server of the same libraries.

    python -m hpcsplit.bench server [--concurrency 1,8,64] [--interval-ms 2000] [--samples 2000]

One run, figures side by side: requests/s, p50 and p99 (perf_analyzer's, client side) at each concurrency
over HTTP with JSON tensors, HTTP with the binary extension, gRPC, and gRPC streaming (ModelStreamInfer), for

* ``hpcsplit``: ``stage=serve runtime.mode=server`` of a trivial model (one 8 -> 8 linear layer, one component:
  frontend + 1 rank under mpiexec), token on, as deployed;
* ``echo``: an aiohttp app and a grpc.aio server in one process answering every infer with a canned response
  (no parsing, no pipeline): the ceiling of the protocol stack in Python on this machine;
* ``hop``: the same echo, but every infer first goes to a peer process and back (a 12-byte header and the
  32 bytes of an answer over a socketpair; the peer does nothing but send them back, batched, as fast as it
  reads them), once with a peer that waits in ``recv`` and once with one that polls for 2 ms after each
  message as the component ranks do (``[Note: spin after work]``).  A split model's components run in other
  processes, so the better of the two is the ceiling of any server of a split model here: what one hop
  costs this machine, before any work of hpcsplit's;
* ``frontend``: the MPI frontend's own ceiling without a protocol: batch mode over ``--samples`` requests.

``server_bench.csv`` and ``server_bench.png`` (requests/s and p50 of every server, a panel per protocol) go to
``--out`` (default ``outputs/bench-server``).

Target (issue 18): hpcsplit >= 70% of echo's rate on each protocol, and under 1 ms added to p50 at
concurrency 1.  The table also gives hpcsplit's rate against the better hop's, and the verdict names the
rows where even the hop is under 70% of the echo (a target no split server can reach on this machine).
perf_analyzer comes from ``scripts/setup-perf.sh`` (its own venv, .venv-perf).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from aiohttp import web
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.launch.local import find_mpiexec
from hpcsplit.switchboard.reader import Switchboard
from hpcsplit.switchboard.writer import export

ROOT = Path(__file__).resolve().parents[2]
MODES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("http-json", "http", "json", ()), ("http-binary", "http", "binary", ()), ("grpc", "grpc", "binary", ()),
    ("grpc-stream", "grpc", "binary", ("--streaming",)))  # ModelStreamInfer: one stream per client


# ------------------------------------------------------------------------------------------- echo
_HOP = struct.Struct("<QI")  # a hop's frame: request number, payload length; then the payload

# The hop's peer: sends back whatever it reads (whole frames or not: the echo side reassembles them).
# "spin": after a message it polls without blocking for 2 ms before it waits in recv again.
_PEER = """
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
spin = sys.argv[2] == "spin"
last = 0.0
while True:
    if spin and time.perf_counter() - last < 0.002:
        try:
            d = s.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
    else:
        d = s.recv(1 << 20)
    if not d:
        break
    s.sendall(d)
    last = time.perf_counter()
"""


class _Hop(asyncio.Protocol):
    """The echo side of a hop: :meth:`call` sends a frame (the frames of one loop turn leave in one write)
    and resolves when the peer has sent it back; if the peer goes, every call waiting fails."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.waiting: dict[int, asyncio.Future[bytes]] = {}
        self.n = 0
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def call(self, payload: bytes) -> asyncio.Future[bytes]:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the hop's peer is gone")
        self.n += 1
        fut = self.waiting[self.n] = self.loop.create_future()
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out += (_HOP.pack(self.n, len(payload)), payload)
        return fut

    def _flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def data_received(self, data: bytes) -> None:
        b = self.buf
        b += data
        at = 0
        while len(b) - at >= _HOP.size:
            n, size = _HOP.unpack_from(b, at)
            if len(b) - at - _HOP.size < size:
                break
            fut = self.waiting.pop(n, None)
            if fut is not None and not fut.done():
                fut.set_result(bytes(b[at + _HOP.size:at + _HOP.size + size]))
            at += _HOP.size + size
        del b[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the hop's peer is gone"))
        self.waiting.clear()


def _echo_main(port_file: str, hop: str | None = None) -> None:
    """The echo server: canned answers for the calls perf_analyzer makes (a subprocess of the bench); with
    ``hop`` ("wait" or "spin"), each infer goes to a peer process and back first."""
    meta = {"name": "echo", "versions": ["1"], "platform": "echo",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 8]}]}
    config = {"name": "echo", "max_batch_size": 64, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [8]}],
              "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [8]}]}
    out = np.zeros((1, 8), np.float32)
    json_body = json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, 8], "data": out.reshape(-1).tolist()}]}).encode()
    head = json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, 8],
         "parameters": {"binary_data_size": out.nbytes}}]}).encode()

    hops: list[_Hop] = []  # the hop, once the loop runs
    mine = peer = None
    if hop is not None:  # the peer ends when this process's end of the socketpair closes
        mine, theirs = socket.socketpair()
        peer = subprocess.Popen([sys.executable, "-c", _PEER, str(theirs.fileno()), hop], pass_fds=(theirs.fileno(),))
        theirs.close()

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        if hops:
            await hops[0].call(out.tobytes())
        if "Inference-Header-Content-Length" in request.headers:
            return web.Response(body=head + out.tobytes(), content_type="application/octet-stream",
                                headers={"Inference-Header-Content-Length": str(len(head))})
        return web.Response(body=json_body, content_type="application/json")

    async def j(obj: Any) -> web.Response:
        return web.json_response(obj)

    app = web.Application()
    app.add_routes([web.get("/v2", lambda _: j({"name": "echo", "version": "1", "extensions": []})),
                    web.get("/v2/models/echo", lambda _: j(meta)),
                    web.get("/v2/models/echo/config", lambda _: j(config)),
                    web.post("/v2/models/echo/infer", infer)])
    T = pb.ModelMetadataResponse.TensorMetadata
    g_meta = pb.ModelMetadataResponse(name="echo", versions=["1"], platform="echo",
                                      inputs=[T(name="x", datatype="FP32", shape=[-1, 8])],
                                      outputs=[T(name="output", datatype="FP32", shape=[-1, 8])])
    g_cfg = pb.ModelConfigResponse(config=mc.ModelConfig(
        name="echo", max_batch_size=64, input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[8])],
        output=[mc.ModelOutput(name="output", data_type=mc.TYPE_FP32, dims=[8])]))
    g_resp = pb.ModelInferResponse(model_name="echo", model_version="1")
    g_resp.outputs.add(name="output", datatype="FP32", shape=[1, 8])
    g_resp.raw_output_contents.append(out.tobytes())

    async def g_infer(_: Any, __: Any) -> Any:
        if hops:
            await hops[0].call(out.tobytes())
        return g_resp

    async def g_stream(requests: Any, _: Any) -> Any:  # perf_analyzer matches a stream's answers by id
        async for r in requests:
            if hops:
                await hops[0].call(out.tobytes())
            resp = pb.ModelStreamInferResponse()
            resp.infer_response.CopyFrom(g_resp)
            resp.infer_response.id = r.id
            yield resp

    def h(fn: Any, req: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                   response_serializer=lambda m: m.SerializeToString())

    async def const(x: Any) -> Any:
        async def f(_: Any, __: Any) -> Any:
            return x
        return f

    async def main() -> None:
        if mine is not None:
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(lambda: _Hop(loop), sock=mine)
            hops.append(proto)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
            "ModelMetadata": h(await const(g_meta), pb.ModelMetadataRequest),
            "ModelConfig": h(await const(g_cfg), pb.ModelConfigRequest),
            "ServerMetadata": h(await const(pb.ServerMetadataResponse(name="echo", version="1")),
                                pb.ServerMetadataRequest),
            "ModelInfer": h(g_infer, pb.ModelInferRequest),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                g_stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=lambda m: m.SerializeToString())}),))
        gport = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tmp = Path(port_file + ".tmp")  # whole or not there: the bench reads it once it exists
        tmp.write_text(json.dumps({"http_port": runner.addresses[0][1], "grpc_port": gport}))
        tmp.replace(port_file)
        await asyncio.Event().wait()

    try:
        asyncio.run(main())
    finally:
        if peer is not None:
            peer.kill()
            peer.wait()


# ------------------------------------------------------------------------------------------ setup
def _toy(tmp: Path) -> tuple[Path, Path, int]:
    """A trivial model (one 8 -> 8 linear layer, one component) exported, and its plan (frontend + 1 rank)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    sb_dir = tmp / "switchboard"
    export(m, (torch.randn(2, 8),), out=sb_dir, name="linear8", cost="flops", stages=1)
    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, 16, 0))
    plan = tmp / "plan.json"
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(plan)
    return sb_dir, plan, len(ranks)


def _mpi_cmd(n: int, cfg: Path, run: Path) -> list[str]:
    return [find_mpiexec(None), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
            "hpcsplit.runtime.stage:mpi_main", str(cfg), str(run)]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _start_hpcsplit(tmp: Path, sb: Path, plan: Path, n: int, runtime: dict[str, Any] | None = None,
                    name: str = "server") -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    """``stage=serve runtime.mode=server`` under mpiexec on this node; returns it once its endpoint is up."""
    cfg = tmp / f"{name}.cfg.json"
    cfg.write_text(json.dumps({"stage": "serve", "plan": str(plan), "switchboard": str(sb),
                               "runtime": {"mode": "server", "server_host": "127.0.0.1", "max_inflight": 256,
                                           "server_queue": 1024, **(runtime or {})}}))
    run = tmp / f"{name}-run"
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(_mpi_cmd(n, cfg, run), env=_env(), stdout=log, stderr=subprocess.STDOUT)
    ep = run / "endpoint.json"
    t_end = time.monotonic() + 180
    while not ep.exists():
        if proc.poll() is not None or time.monotonic() > t_end:
            raise SystemExit(f"the hpcsplit server did not start; log: {tmp / f'{name}.log'}")
        time.sleep(0.2)
    time.sleep(0.2)
    info = json.loads(ep.read_text())
    return proc, info, Path(info["token_file"]).read_text().strip()


def _frontend_ceiling(tmp: Path, sb: Path, plan: Path, n: int, samples: int) -> float | None:
    cfg = tmp / "batch.cfg.json"
    cfg.write_text(json.dumps({"stage": "serve", "plan": str(plan), "switchboard": str(sb),
                               "runtime": {"mode": "batch", "num_samples": samples, "max_inflight": 256,
                                           "verify": False}}))
    run = tmp / "batch-run"
    subprocess.run(_mpi_cmd(n, cfg, run), env=_env(), capture_output=True, timeout=300, check=False)
    try:
        res = json.loads((run / "runtime.mpi_main.result.json").read_text())
        return float(res["variants"]["split"]["throughput_rps"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _perf(pa: Path, model: str, port: int, protocol: str, fmt: str, conc: int, interval_ms: int, token: str | None,
          out: Path, extra: tuple[str, ...] = (), timeout_s: float = 120.0) -> tuple[float, float, float] | None:
    """One perf_analyzer level: (infer/s, p50 ms, p99 ms), or None (said on stderr) when it measured nothing."""
    cmd = [str(pa), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency-range", str(conc),
           "--measurement-interval", str(interval_ms), "--stability-percentage", "50", "--max-trials", "6",
           "-f", str(out), *extra]
    if protocol == "http":
        cmd += ["--input-tensor-format", fmt, "--output-tensor-format", fmt]
    if token:
        cmd += ["-H", f"{'Authorization' if protocol == 'http' else 'authorization'}:Bearer {token}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        print(f"  perf_analyzer did not finish within {timeout_s:g} s (concurrency {conc})", file=sys.stderr)
        return None
    if p.returncode not in (0, 2) or not out.exists():
        print(f"  perf_analyzer failed (rc {p.returncode}): {(p.stderr or p.stdout)[-300:]}", file=sys.stderr)
        return None
    rows = list(csv.DictReader(out.open()))
    if not rows:
        return None
    r = rows[-1]
    return float(r["Inferences/Second"]), float(r["p50 latency"]) / 1e3, float(r["p99 latency"]) / 1e3


def perf_analyzer() -> Path | None:
    """perf_analyzer from ``scripts/setup-perf.sh`` (installed on first use), or None (said on stderr)."""
    setup = subprocess.run([str(ROOT / "scripts" / "setup-perf.sh")], capture_output=True, text=True, check=False)
    if setup.returncode != 0 or not setup.stdout.strip():
        print(f"perf_analyzer is not available (scripts/setup-perf.sh): {setup.stderr[-500:]}", file=sys.stderr)
        return None
    return ROOT / setup.stdout.strip().splitlines()[-1]


ECHOES = (("echo", None), ("hop-wait", "wait"), ("hop-spin", "spin"))


def _start_echoes(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> dict[str, dict[str, int]]:
    """Start the echo server and the two hop servers, each a process of its own (appended to ``procs``,
    which the caller stops whatever happens); their ports."""
    files = {}
    for name, hop in ECHOES:
        files[name] = tmp / f"{name}.json"
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcsplit.bench", "server", "--echo-server",
                                       str(files[name]), *(("--hop", hop) if hop else ())], env=_env()))
    ports: dict[str, dict[str, int]] = {}
    t_end = time.monotonic() + 60
    for (name, f), proc in zip(files.items(), procs, strict=True):
        while not f.exists():
            if proc.poll() is not None:
                raise SystemExit(f"the {name} server exited (rc {proc.returncode}) before it listened")
            if time.monotonic() > t_end:
                raise SystemExit(f"the {name} server did not start within 60 s")
            time.sleep(0.1)
        ports[name] = json.loads(f.read_text())
    return ports


def _row(x: Any, width: int = 10) -> str:
    return f"{x[0]:>{width}.0f} {x[1]:>6.2f} {x[2]:>6.2f}" if x else f"{'n/a':>{width}} {'':>6} {'':>6}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcsplit.bench server", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer's measurement interval")
    p.add_argument("--samples", type=int, default=2000, help="requests of the frontend-ceiling batch run")
    p.add_argument("--out", type=Path, default=Path("outputs/bench-server"), help="where the CSV and PNG go")
    p.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)  # internal: run an echo server
    p.add_argument("--hop", choices=("wait", "spin"), default=None, help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.echo_server:
        _echo_main(args.echo_server, args.hop)
        return 0
    pa = perf_analyzer()
    if pa is None:
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="hpcsplit-bench-server-") as d:
        tmp = Path(d)
        sb, plan, n = _toy(tmp)
        ceiling = _frontend_ceiling(tmp, sb, plan, n, args.samples)
        echoes: list[subprocess.Popen[bytes]] = []
        srv = None
        try:
            eports = _start_echoes(tmp, echoes)
            srv, info, token = _start_hpcsplit(tmp, sb, plan, n)
            table: list[tuple[str, int, dict[str, Any]]] = []
            steps = len(MODES) * len(levels)
            for label, proto, fmt, extra in MODES:
                for c in levels:
                    k = f"{label}-{c}"
                    got: dict[str, Any] = {}
                    for name, _ in ECHOES:
                        got[name] = _perf(pa, "echo", eports[name][f"{proto}_port"], proto, fmt, c, args.interval_ms,
                                          None, tmp / f"{name}-{k}.csv", extra)
                    got["hpcsplit"] = _perf(pa, info["model"], info[f"{proto}_port"], proto, fmt, c, args.interval_ms,
                                            token, tmp / f"h-{k}.csv", extra)
                    table.append((label, c, got))
                    print(f"  [{len(table)}/{steps}] {label} at concurrency {c}: " + ", ".join(
                        f"{name} {r[0]:.0f} req/s" if r else f"{name} n/a" for name, r in got.items()),
                        file=sys.stderr, flush=True)
        finally:
            if srv is not None:
                srv.send_signal(signal.SIGTERM)
            for ep in echoes:
                ep.terminate()
            for p_, grace in ([(srv, 60.0)] if srv is not None else []) + [(ep, 10.0) for ep in echoes]:
                try:
                    p_.wait(grace)
                except subprocess.TimeoutExpired:
                    p_.kill()
                    p_.wait()
    print(f"python -m hpcsplit.bench server: trivial model (one 8 -> 8 linear layer, frontend + 1 component rank), "
          f"perf_analyzer {args.interval_ms} ms windows, {os.cpu_count()} cores")
    print(f"MPI frontend's own ceiling (batch mode, {args.samples} requests, no protocol): "
          + (f"{ceiling:.0f} req/s" if ceiling else "n/a"))
    print("req/s, p50 ms, p99 ms; hop: the echo with one round trip to a do-nothing peer process (it waits / it spins)")
    print(f"{'protocol':<12} {'conc':>4} | {'echo':>10} {'p50':>6} {'p99':>6} | {'hop wait':>10} {'p50':>6} {'p99':>6} | "
          f"{'hop spin':>10} {'p50':>6} {'p99':>6} | {'hpcsplit':>10} {'p50':>6} {'p99':>6} | {'hop/echo':>8} "
          f"{'rate/echo':>9} {'rate/hop':>8} {'+p50 ms':>8}")
    verdict, unreachable = [], []
    for label, c, got in table:
        e, h = got["echo"], got["hpcsplit"]
        hops = [x for x in (got["hop-wait"], got["hop-spin"]) if x]
        best = max(hops, key=lambda x: x[0]) if hops else None
        e = e if e and e[0] > 0 else None  # perf_analyzer measured nothing: no ratios against it
        best = best if best and best[0] > 0 else None
        hop_r = f"{best[0] / e[0]:>8.2f}" if e and best else f"{'n/a':>8}"
        ratio = f"{h[0] / e[0]:>9.2f}" if e and h else f"{'n/a':>9}"
        vs_hop = f"{h[0] / best[0]:>8.2f}" if h and best else f"{'n/a':>8}"
        dp50 = f"{h[1] - e[1]:>8.2f}" if e and h else f"{'n/a':>8}"
        print(f"{label:<12} {c:>4} | {_row(e)} | {_row(got['hop-wait'])} | {_row(got['hop-spin'])} | {_row(h)} | "
              f"{hop_r} {ratio} {vs_hop} {dp50}")
        if e and h:
            verdict.append((label, c, h[0] / e[0], h[1] - e[1]))
        if e and best and best[0] / e[0] < 0.7:
            unreachable.append(f"{label} at {c}")
    ok_rate = bool(table) and len(verdict) == len(table) and all(r >= 0.7 for _, _, r, _ in verdict)
    low = [d for _, c, _, d in verdict if c == min(levels)]
    print(f"verdict: rate >= 70% of echo on every row: {'yes' if ok_rate else 'no'}; added p50 at concurrency "
          f"{min(levels)}: {', '.join(f'{d:.2f}' for d in low)} ms (target < 1 ms)")
    print("rows where one hop to a do-nothing peer is already under 70% of the echo (out of reach of any split "
          f"server on this machine): {', '.join(unreachable) if unreachable else 'none'}")
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png = args.out / "server_bench.csv", args.out / "server_bench.png"
    names = [name for name, _ in ECHOES] + ["hpcsplit"]
    with csv_path.open("w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["protocol", "concurrency", *(f"{n}_{k}" for n in names for k in ("req_per_s", "p50_ms", "p99_ms"))])
        for label, c, got in table:
            wr.writerow([label, c, *(v for n in names for v in (got[n] or ("", "", "")))])
    _plot(png, table, names, levels)
    print(f"written: {csv_path}, {png}")
    return 0


def _plot(path: Path, table: list[tuple[str, int, dict[str, Any]]], names: list[str], levels: list[int]) -> None:
    """Requests/s (solid) and p50 (dashed, right axis) against concurrency, a panel per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [m[0] for m in MODES]
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 4), squeeze=False)
    colors = dict(zip(names, ("tab:gray", "tab:green", "tab:olive", "tab:blue"), strict=False))
    for ax, label in zip(axes[0], labels, strict=True):
        rows = {c: got for lab, c, got in table if lab == label}
        lat = ax.twinx()
        for n in names:
            xs = [c for c in levels if rows.get(c, {}).get(n)]
            ax.plot(xs, [rows[c][n][0] for c in xs], "o-", color=colors[n], label=n)
            lat.plot(xs, [rows[c][n][1] for c in xs], "x--", color=colors[n], alpha=0.6)
        ax.set(title=label, xlabel="concurrency", xscale="log", xticks=levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        lat.set_ylabel("p50 ms (dashed)")
    axes[0][0].set_ylabel("req/s (solid)")
    axes[0][0].legend(loc="upper left")
    fig.suptitle("python -m hpcsplit.bench server: echo, one hop, hpcsplit")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
