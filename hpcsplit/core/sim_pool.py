"""Many simulations at once: independent sessions (levels, runs, candidates) spread over the machine's cores.

[Note: simulations in parallel]
Every :func:`~hpcsplit.core.simulator.simulate` call is a pure function of its system, arrivals and seed, so the
sessions of a stage (``stage=simulate``: variants x arrival processes x levels x runs; ``stage=allocate`` with
``allocate.rate_rps``: candidates x runs; ``python -m hpcsplit.bench simulate``'s 10 loads) are independent.
:func:`simulate_many` runs them in ``workers`` processes forked from the caller (the systems and arrivals are
inherited, not pickled; only the results come back) and returns them in the tasks' order, the same figures as
one after the other in any order on any number of workers (``tests/unit/test_simulator.py`` checks it).

- ``workers=None`` (``simulate.workers`` / ``allocate.sim_workers`` null): one per core this process may run on
  (``os.sched_getaffinity``), at most :data:`AUTO_MAX` (a shared login node), at most one per task;
- one worker, one task, or a platform without ``fork``: in this process, as before;
- a worker that dies (killed, out of memory) ends the call with an ``HpcsplitError`` naming the task;
- no worker outlives the call: they end with it, are terminated when it is interrupted (an error, Ctrl-C, a
  SIGTERM handler's exception) rather than left to finish their sessions, and get SIGKILL from the kernel when
  the caller dies (``die_with_parent``);
- a deadline: when no session finishes for longer than the longest pending one may take (:func:`session_bound_s`,
  a bound far above a session's real time, by its requests and components), the call ends with an
  ``HpcsplitError`` (a hung worker: a lock held at the fork, say) and its workers are terminated;
- progress: a line every :data:`PROGRESS_EVERY_S` seconds while the tasks last longer than that.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from hpcsplit.core.procs import die_with_parent
from hpcsplit.core.simulator import SimRun, SimSystem, simulate
from hpcsplit.errors import HpcsplitError

__all__ = ["AUTO_MAX", "SimTask", "auto_workers", "session_bound_s", "simulate_many"]

AUTO_MAX = 8  # workers=None: at most this many processes
PROGRESS_EVERY_S = 10.0
# session_bound_s: a session of n requests through k components takes about 80 us a request and component on
# this project's 2-core VM (256 GPUs x 12 components: 1.47 million events in 16 s); the bound allows 25 times
# that, plus a floor for a slow machine's first events
BOUND_FLOOR_S = 120.0
BOUND_PER_REQUEST_AND_COMPONENT_S = 2e-3

SimTask = tuple[SimSystem, np.ndarray, int]  # (system, arrival offsets in seconds, jitter seed)

_TASKS: Sequence[SimTask] = ()  # the call's tasks, inherited by the forked workers


def auto_workers(n_tasks: int, workers: int | None = None) -> int:
    """How many processes :func:`simulate_many` uses for ``n_tasks`` tasks (``workers`` None: automatic).

    >>> auto_workers(3, 8), auto_workers(0), auto_workers(5, 1)
    (3, 1, 1)
    """
    if workers is None:
        try:
            workers = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            workers = os.cpu_count() or 1
        workers = min(workers, AUTO_MAX)
    return max(1, min(int(workers), n_tasks))


def session_bound_s(task: SimTask) -> float:
    """Seconds past which a session is taken for hung (``[Note: simulations in parallel]``): far above what it takes,
    :data:`BOUND_FLOOR_S` plus :data:`BOUND_PER_REQUEST_AND_COMPONENT_S` per request and component."""
    system, arr, _ = task
    return BOUND_FLOOR_S + BOUND_PER_REQUEST_AND_COMPONENT_S * len(arr) * max(1, len(system.components))


def _worker(parent: int) -> None:
    """A worker's start: killed with its parent; SIGTERM ends it (not a handler inherited from the caller), and
    Ctrl-C is its parent's to act on (the parent then terminates it)."""
    die_with_parent(parent)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _timed(task: SimTask) -> tuple[SimRun, float]:
    """One session and the wall seconds it took."""
    system, arr, seed = task
    t0 = time.perf_counter()
    return simulate(system, arr, seed=seed), time.perf_counter() - t0


def _run(i: int) -> tuple[SimRun, float]:
    return _timed(_TASKS[i])  # (a worker's: the task inherited from the caller)


def simulate_many(tasks: Sequence[SimTask], workers: int | None = None,
                  progress: Callable[[str], None] | None = print) -> list[tuple[SimRun, float]]:
    """Simulate each ``(system, arrivals, seed)`` of ``tasks``; ``(run, wall seconds it took)`` per task, in order
    (``[Note: simulations in parallel]``)."""
    global _TASKS
    n = auto_workers(len(tasks), workers)
    if n <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [_timed(t) for t in tasks]
    _TASKS = tasks
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"), initializer=_worker,
                               initargs=(os.getpid(),))
    try:
        pending = {pool.submit(_run, i): i for i in range(len(tasks))}
        return _collect(pending, n, progress, [session_bound_s(t) for t in tasks])
    except BaseException:  # an error, Ctrl-C, SIGTERM: the sessions still running are not waited for
        pool.shutdown(wait=False, cancel_futures=True)
        ours = [p for p in multiprocessing.active_children() if p not in before]
        for p in ours:
            p.terminate()
        for p in ours:
            p.join(2.0)
        for p in ours:  # one that outlived SIGTERM (it came before the worker's start reset the handler it inherited)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        raise
    finally:
        pool.shutdown(wait=True)
        _TASKS = ()


def _collect(pending: dict[Future[tuple[SimRun, float]], int], n: int,
             progress: Callable[[str], None] | None, bounds_s: Sequence[float]) -> list[tuple[SimRun, float]]:
    """The results of ``pending`` (future -> task index) in the tasks' order, as the workers finish them; a progress
    line every :data:`PROGRESS_EVERY_S`; an error when none finishes within the longest pending one's bound
    (``bounds_s``, per task)."""
    total = len(pending)
    results: dict[int, tuple[SimRun, float]] = {}
    t0 = shown = last = time.perf_counter()
    while pending:
        quiet = max(bounds_s[i] for i in pending.values())  # no pending session may take longer than this
        left = last + quiet - time.perf_counter()
        if left <= 0:
            raise HpcsplitError(
                f"no simulation finished in {quiet:.3g} s, longer than any of the {len(pending)} left (of {total}) may "
                f"take: a worker process hung? Rerun with simulate.workers / allocate.sim_workers = 1 (in this process)")
        done, _ = wait(pending, timeout=min(PROGRESS_EVERY_S, left), return_when=FIRST_COMPLETED)
        if done:
            last = time.perf_counter()
        for f in done:
            i = pending.pop(f)
            try:
                r, dt = f.result()
            except BrokenProcessPool as e:
                raise HpcsplitError(
                    f"a simulation worker process died (task {i + 1} of {total}; killed, or out of memory?): rerun "
                    f"with fewer workers (simulate.workers / allocate.sim_workers = 1 runs them in this process)") from e
            results[i] = (r, dt)
        now = time.perf_counter()
        if progress is not None and pending and now - shown >= PROGRESS_EVERY_S:
            shown = now
            progress(f"simulated {total - len(pending)} of {total} sessions on {n} processes ({now - t0:.0f} s)")
    return [results[i] for i in range(total)]
