"""The login side's server restarts (``[Note: server restarts]``), the rank keeper (``[Note: rank keeper]``) and
the server's token file, each on its own: real processes and files, the job replaced by a function that
writes what a job writes (endpoint.json, rank 0's result).  The real jobs are in tests/mpi/test_server_faults.py
and tests/multinode/test_server_node_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.errors import JobTimedOut, LaunchError
from hpcsplit.launch import serve_watch
from hpcsplit.launch.keeper import KEEPER_VAR, server_faults
from hpcsplit.launch.serve_watch import restart_on_cluster, serve_with_restarts


def _job(paths: RunPaths, port: int, result: Any = None, error: LaunchError | None = None) -> Any:
    """A stand-in job: it serves (endpoint.json, a token), lives long enough for the watch to see it, ends."""
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    if not paths.server_token.exists():
        paths.server_token.write_text("t" * 32 + "\n")
        paths.server_token.chmod(0o600)
    paths.server_endpoint.write_text(json.dumps({"host": "127.0.0.1", "http_port": port, "grpc_port": port + 1,
                                                 "model": "m", "token_file": str(paths.server_token),
                                                 "started": time.time()}))
    time.sleep(0.7)  # the watch polls every 0.5 s
    paths.server_endpoint.unlink()
    if error is not None:
        raise error
    return result


def _restart(why: str) -> dict[str, Any]:
    return {"lost_ranks": {"1": "rank 1 (...): its process ended"},
            "variants": {"split": {"server": {"restart": why}}}}


def test_a_job_that_lost_its_last_replica_is_started_again_on_the_same_ports_and_token(tmp_path: Path) -> None:
    paths = RunPaths.from_config({}, tmp_path / "run")
    seen: list[dict[str, Any]] = []
    lines: list[str] = []

    def run(cfg: dict[str, Any]) -> Any:
        seen.append(cfg)
        if len(seen) == 1:
            return _job(paths, 8000, _restart("component 'a' lost its last replica"))
        if len(seen) == 2:
            paths.server_token.unlink()  # as a job stopped by its scheduler leaves it: the login side writes it back
            return _job(paths, 8000, error=LaunchError("SLURM job 5 (stage=serve) ended NODE_FAIL"))
        return _job(paths, 8000, {"variants": {"split": {"server": {"requests": 3}}}})

    cfg = {"runtime": {"server_http_port": 0, "server_grpc_port": 0, "server_token": True}}
    out = serve_with_restarts(run, cfg, paths, lines.append, 10.0, restarts=3, backoff_s=0.0)
    assert out == {"variants": {"split": {"server": {"requests": 3}}}} and len(seen) == 3
    rt = seen[2]["runtime"]
    assert (rt["server_http_port"], rt["server_grpc_port"], rt["server_port_fallback"]) == (8000, 8001, True)
    assert rt["server_token_file"] == str(paths.server_token)
    assert paths.server_token.read_text().strip() == "t" * 32 and paths.server_token.stat().st_mode & 0o777 == 0o600
    text = "\n".join(lines)
    assert "the server job ended after serving: component 'a' lost its last replica" in text
    assert "ended NODE_FAIL" in text and "restart 2 of 3 in a row" in text, text


def test_restarts_stop_when_used_up_and_are_never_for_a_job_that_did_not_serve(tmp_path: Path) -> None:
    paths = RunPaths.from_config({}, tmp_path / "run")
    calls = [0]

    def crash(cfg: dict[str, Any]) -> Any:
        calls[0] += 1
        return _job(paths, 8000, error=LaunchError("rank 2 raised"))

    with pytest.raises(LaunchError, match="launcher.restarts=2 restarts in a row are used up"):
        serve_with_restarts(crash, {}, paths, lambda _: None, 10.0, restarts=2, backoff_s=0.0)
    assert calls[0] == 3

    def never_ready(cfg: dict[str, Any]) -> Any:
        raise LaunchError("the ranks failed to load")

    with pytest.raises(LaunchError, match="failed to load"):
        serve_with_restarts(never_ready, {}, paths, lambda _: None, 10.0, restarts=3, backoff_s=0.0)

    def timed_out(cfg: dict[str, Any]) -> Any:
        return _job(paths, 8000, error=JobTimedOut("ran past launcher.timeout_min"))

    with pytest.raises(JobTimedOut):
        serve_with_restarts(timed_out, {}, paths, lambda _: None, 10.0, restarts=3, backoff_s=0.0)
    # a server stopped on purpose (drained) is not restarted
    assert serve_with_restarts(lambda c: _job(paths, 8000, {"variants": {}}), {}, paths, lambda _: None, 10.0,
                               restarts=3, backoff_s=0.0) == {"variants": {}}
    assert server_faults({"variants": {}}) is None


def _two_node_plan(path: Path, device: str = "cpu") -> None:
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0), RankEntry(1, "component", 0, None, None, 1, "a", 2, 0),
             RankEntry(2, "component", 1, None, None, 1, "b", 2, 0)]
    if device == "cuda":
        ranks = [ranks[0], RankEntry(1, "component", 0, 0, 10.0, 1, "a", 2, 0),
                 RankEntry(2, "component", 1, 0, 10.0, 1, "b", 2, 0)]
    Plan("m", None, device, 2, tuple(ranks), {"a": 1.0, "b": 1.0}, {}).save(path)


def test_a_cpu_plan_is_folded_onto_the_nodes_left_and_a_gpu_plan_says_why_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sinfo = "node1|idle|none\nnode2|down*|Not responding\n"
    monkeypatch.setattr(serve_watch, "_run", lambda cmd: sinfo if cmd[0] == "sinfo" else None)  # the cluster's answer
    run = tmp_path / "run"
    run.mkdir()
    _two_node_plan(tmp_path / "plan.json")
    cfg = {"plan": str(tmp_path / "plan.json"), "cluster": {"name": "dev2", "nodes": 2, "cpu_threads": [1],
                                                          "slurm": {"partition": "debug"}}}
    lines: list[str] = []
    new = restart_on_cluster(cfg, run, lines.append)
    folded = Plan.load(new["plan"])
    assert folded.nodes == 1 and [r.node for r in folded.ranks] == [0, 0, 0] and folded.world_size == 3
    assert "node2 down* (Not responding)" in lines[0] and "on 1 node(s)" in lines[0]
    sinfo = "node1|idle|none\nnode2|idle|none\n"
    assert restart_on_cluster(cfg, run, lines.append) is cfg  # both nodes back: the plan as it was
    _two_node_plan(tmp_path / "gpu.json", "cuda")
    sinfo = "node1|idle|none\nnode2|drained|maintenance\n"
    with pytest.raises(LaunchError, match=r"needs 2 node\(s\) and the partition has 1 .*node2 drained \(maintenance\)"):
        restart_on_cluster({**cfg, "plan": str(tmp_path / "gpu.json")}, run, lines.append)


def test_the_keeper_turns_its_rank_s_death_into_an_exit_code(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.set_inheritable(w, True)
    code = ("import os, signal, sys; os.write(int(sys.argv[1]), repr((os.environ.get('" + KEEPER_VAR + "'), "
            "signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)).encode()); os.close(int(sys.argv[1])); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-m", "hpcsplit.launch.keeper", sys.executable, "-c", code, str(w)],
                       pass_fds=(w,), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PMI_RANK": "3"}, check=False)
    os.close(w)
    seen = os.read(r, 1000).decode()
    os.close(r)
    assert p.returncode == 128 + signal.SIGKILL, p.stderr  # an exit, not a death by a signal: hydra spares the rest
    assert "[rank 3] was killed by SIGKILL" in p.stderr
    keeper_pid, usr1_ignored = eval(seen)
    assert keeper_pid and usr1_ignored  # the rank knows its keeper, and hydra's SIGUSR1 ends neither
    assert subprocess.run([sys.executable, "-m", "hpcsplit.launch.keeper", sys.executable, "-c", "raise SystemExit(4)"],
                          timeout=60, check=False).returncode == 4


def test_a_token_file_is_one_private_line(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from hpcsplit.errors import RuntimeStageError
    from hpcsplit.runtime.server.failover import read_token

    tok = tmp_path / "tok"
    tok.write_text("abcdefghijklmnop_XYZ-0123456789\n")
    tok.chmod(0o600)
    assert read_token(tok) == "abcdefghijklmnop_XYZ-0123456789"
    tok.chmod(0o644)
    with pytest.raises(RuntimeStageError, match="may be read by others"):
        read_token(tok)
    for bad in ("short", "two words here and there", "x" * 600, "a\nb" * 10):
        tok.write_text(bad)
        tok.chmod(0o600)
        with pytest.raises(RuntimeStageError, match="does not hold one token"):
            read_token(tok)
    link = tmp_path / "link"
    link.symlink_to(tok)
    with pytest.raises(RuntimeStageError, match="cannot open it"):
        read_token(link)
