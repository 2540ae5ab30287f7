"""Launch ranks from a notebook: what ``torchrun`` does for one machine, driven from Python. Used by lessons 10,
10b, 11 and 11b.

The engine is PyTorch's own DDP; nothing here imitates it. ``launch`` does what ``torchrun`` does
for one machine (it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... and starts the processes)
so a lesson can run ranks without a terminal, and it collects each rank's return value::

    from ampviz.lessons.launch import Workers, launch
    from ampviz.lessons import ddp_ranks
    launch(ddp_ranks.hello, nprocs=2)           # [{'rank': 0, ...}, {'rank': 1, ...}]

    workers = Workers(2)                        # start two ranks once (imports cost seconds) ...
    workers.run(ddp_ranks.hello)                # ... then run several functions on them
    workers.close()

The function must be importable (defined in a module, not in a notebook): the ``spawn`` start
method pickles it by name and the child imports it (from a script, call ``launch`` under
``if __name__ == "__main__":``, since the children import the script too). Its return value travels back through
``torch.save`` / ``torch.load(weights_only=True)``, so return tensors, numbers, strings, lists
and dicts. Inside the function, ``init_from_env()`` (from :mod:`ampviz.examples.process_group`, re-exported
here) joins the process group exactly as it would under ``torchrun``.
"""

from __future__ import annotations

import io
import multiprocessing.connection
import os
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from .._args import check_int
from ..examples.process_group import init_from_env

__all__ = ["LaunchError", "Workers", "free_port", "init_from_env", "launch"]


class LaunchError(RuntimeError):
    """Ranks failed or timed out: ``.outcomes`` maps each rank to "ok" or one line saying what
    happened; ``.tracebacks`` holds the full traceback of each rank that raised."""

    def __init__(self, message: str, outcomes: dict, tracebacks: dict | None = None):
        super().__init__(message)
        self.outcomes, self.tracebacks = outcomes, tracebacks or {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """``nprocs`` ranks on this machine, started once and kept for several calls (like torchrun's
    workers, but driven from Python). Each :meth:`run` executes ``fn(*args)`` on every rank.

    Parameters
    ----------
    nprocs : number of ranks.
    timeout : default seconds a :meth:`run` may take before the ranks are terminated.
    threads : CPU threads per rank (default: the CPU count divided among the ranks).
    grace : once a rank has failed, seconds the others get to stop by themselves (their collectives
        fail or time out) before they are terminated.

    ``fn`` must be a module-level function (picklable by name). If a rank raises, the others are
    given ``grace`` seconds to stop by themselves, then terminated, and
    :class:`LaunchError` names every rank's fate; the workers are closed after a failure.
    """

    def __init__(self, nprocs: int = 2, timeout: float = 120.0, threads: int | None = None, grace: float = 30.0):
        check_int("nprocs", nprocs, low=1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.nprocs, self.timeout, self.grace = nprocs, float(timeout), float(grace)
        threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs)}
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(nprocs)]           # one duplex pipe per rank: no shared locks
        self._conns = [parent for parent, _ in pipes]
        self._procs = [ctx.Process(target=_serve, args=(r, env, threads, child), daemon=True)
                       for r, (_, child) in enumerate(pipes)]
        for p in self._procs:
            p.start()
        for _, child in pipes:
            child.close()                                     # the children hold their ends now
        self.closed = False

    def run(self, fn, *args, timeout: float | None = None) -> list:
        """Run ``fn(*args)`` on every rank; return the return values ordered by rank."""
        if self.closed:
            raise RuntimeError("Workers are closed (a rank failed, or close() was called); start new ones")
        _check_importable(fn)
        outcomes, values, tracebacks = self._send_all(fn, args), {}, {}
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while len(outcomes) < self.nprocs and time.monotonic() < deadline:
            waiting = {self._conns[r]: r for r in range(self.nprocs) if r not in outcomes}
            for conn in multiprocessing.connection.wait(list(waiting), timeout=deadline - time.monotonic()):
                rank = waiting[conn]
                try:
                    ok, payload = conn.recv()
                except (EOFError, OSError):               # the process died without answering
                    self._procs[rank].join(1)
                    ok, payload = False, (f"died (exit status {self._procs[rank].exitcode})", "")
                outcomes[rank] = "ok" if ok else payload[0]
                if ok:
                    values[rank] = torch.load(io.BytesIO(payload), weights_only=True)
                else:
                    tracebacks[rank] = payload[1]
                    deadline = min(deadline, time.monotonic() + self.grace)   # the others get a grace period
        if len(values) == self.nprocs:
            return [values[r] for r in range(self.nprocs)]
        for r in range(self.nprocs):
            outcomes.setdefault(r, "still running at the deadline (terminated)")
        self.close()
        lines = "\n".join(f"  rank {r}: {outcomes[r]}" for r in range(self.nprocs))
        failed = sum(o != "ok" for o in outcomes.values())
        raise LaunchError(f"{failed} of {self.nprocs} ranks failed running {fn.__qualname__}:\n{lines}", outcomes,
                          tracebacks)

    @property
    def pids(self) -> list:
        """Process ids of the ranks, ordered by rank."""
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> list:
        """Whether each rank's process is still running, ordered by rank."""
        return [p.is_alive() for p in self._procs]

    def _send_all(self, fn, args) -> dict:
        """Hand ``fn(*args)`` to every rank; a rank that died while idle is an outcome, not a BrokenPipeError.

        When one has died, no rank is given the task (the others would wait on it in their first
        collective): every outcome is filled in, so :meth:`run` raises LaunchError at once.
        """
        dead = {r: f"died while idle, before {fn.__qualname__} (exit status {p.exitcode})"
                for r, p in enumerate(self._procs) if not p.is_alive()}
        if not dead:
            for r, conn in enumerate(self._conns):
                try:
                    conn.send((fn, args))
                except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                    self._procs[r].join(1)
                    dead[r] = f"died while idle, before {fn.__qualname__} (exit status {self._procs[r].exitcode})"
        if dead:
            for r in range(self.nprocs):
                dead.setdefault(r, f"not run: rank {min(dead)} had died (terminated)")
        return dead

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        if self.closed:
            return
        self.closed = True
        for conn, p in zip(self._conns, self._procs):
            if p.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()

    def __repr__(self) -> str:
        alive = sum(p.is_alive() for p in self._procs)
        return f"Workers({self.nprocs} ranks, {'closed' if self.closed else 'running'}, {alive} processes alive)"

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "closed", True):
            self.close()


def launch(fn, nprocs: int = 2, args: tuple = (), timeout: float = 120.0, threads: int | None = None,
           grace: float = 30.0) -> list:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes on this machine, like ``torchrun``; return
    each rank's return value, ordered by rank. See :class:`Workers` for the parameters and errors."""
    _check_importable(fn)
    with Workers(nprocs, timeout, threads, grace) as workers:
        return workers.run(fn, *args)


def _check_importable(fn) -> None:
    if not callable(fn) or "<locals>" in getattr(fn, "__qualname__", "<locals>") \
            or getattr(fn, "__module__", "__main__") == "__main__":
        raise ValueError(f"fn: expected a function defined at the top level of an importable module "
                         f"(spawned processes import it by name), got {fn!r}")


def _serve(rank, env, threads, conn):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    # tqdm would create a multiprocessing lock (a named semaphore) that os._exit below never releases
    tqdm.set_lock(threading.RLock())
    try:
        while (task := conn.recv()) is not None:
            fn, args = task
            try:
                buffer = io.BytesIO()
                torch.save(fn(*args), buffer)
                conn.send((True, buffer.getvalue()))
            except BaseException as e:                # report, then stop: the group may be broken
                first = f"{type(e).__name__}: {' '.join(str(e).split())}"
                conn.send((False, (f"raised {first}", traceback.format_exc())))
                break
    except (EOFError, KeyboardInterrupt):             # the parent went away, or Ctrl-C reached us too
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
    os._exit(0)                                       # skip the interpreter's slow teardown of torch
