"""Verifiers in worker processes, each call under a wall-clock limit.

A verifier (math-verify's sympy) can run for hours on a crafted answer, and its own timeouts
need SIGALRM on the main thread. Here every call runs in a worker process; a call that overruns
``timeout_s`` has its worker killed and replaced, and comes back as :data:`TIMEOUT`, so a batch
never waits on one answer longer than the limit (plus the kill).

Workers are fresh interpreters (``python -m sparrow_jax.rl.verifier_pool``, the spawn model),
never forks: forking a process that runs JAX copies its threads' locks mid-flight, and unlike
multiprocessing's spawn and forkserver they do not re-import the caller's main script. They talk
over two private pipes. A fresh worker says when it is ready, and only then gets work, so its
start-up (importing sympy) never counts against an answer's limit.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Sequence

from sparrow_jax.config import ConfigError

OK, TIMEOUT, ERROR = "ok", "timeout", "error"


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """workers: processes; timeout_s: wall-clock limit of one call; start_timeout_s: how long a
    fresh worker may take to import its verifier; memory_mb: address-space cap of a worker (a
    runaway computation fails with MemoryError instead of taking the host; None: no cap)."""

    workers: int = 4
    timeout_s: float = 10.0
    start_timeout_s: float = 120.0
    memory_mb: int | None = 8192

    def __post_init__(self):
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"verifier pool: workers must be an int >= 1, got {self.workers!r}")
        for name in ("timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"verifier pool: {name} must be > 0, got "
                                  f"{getattr(self, name)!r}")
        if self.memory_mb is not None and self.memory_mb < 256:
            raise ConfigError(f"verifier pool: memory_mb must be >= 256 or null, got "
                              f"{self.memory_mb!r}")


def _function(path: str) -> Callable[..., Any]:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _name(fn: Callable[..., Any]) -> str:
    name = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in name or fn.__module__ == "__main__":
        raise ValueError(f"a verifier pool runs module-level functions of importable modules, "
                         f"got {name}")
    return name


def _serve(tasks: Connection, results: Connection, fn, warm, memory_mb) -> None:
    """A worker's loop: ``(index, args)`` in, ``(index, ok, value)`` out, until the pool
    kills it."""
    if memory_mb is not None:
        import resource

        cap = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if warm is not None:
        warm()
    results.send("ready")
    while True:
        index, args = tasks.recv()
        try:
            results.send((index, True, fn(*args)))
        except Exception as e:          # the verifier's failure is this call's, not the pool's
            results.send((index, False, f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, fn: str, warm: str | None, memory_mb: int | None):
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        env = dict(os.environ)
        # The worker imports this package the way this process did, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sparrow_jax.rl.verifier_pool", fn, warm or "",
             str(memory_mb or 0), str(task_r), str(result_w)],
            pass_fds=(task_r, result_w), stdin=subprocess.DEVNULL, env=env)
        os.close(task_r)
        os.close(result_w)
        self.tasks = Connection(task_w, readable=False)
        self.conn = Connection(result_r, writable=False)
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None       # index of the call it runs
        self.deadline = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.tasks.close()
        self.conn.close()


class VerifierPool:
    """``pool.map(args_list)`` -> one ``(status, value)`` per call of ``fn(*args)``: status
    :data:`OK` (value: the result), :data:`TIMEOUT` or :data:`ERROR` (value: a message).

    ``fn`` and ``warm`` (run once per worker before it is ready, e.g. an import) must be
    module-level functions. One ``map`` at a time (a lock); safe to call from any thread.
    """

    def __init__(self, fn: Callable[..., Any], config: PoolConfig = PoolConfig(),
                 warm: Callable[[], None] | None = None):
        self.fn, self.warm, self.config = _name(fn), warm and _name(warm), config
        self._lock = threading.Lock()
        self._workers = [self._start() for _ in range(config.workers)]
        self.replaced = 0           # workers killed and replaced (timeouts, crashes)

    def _start(self) -> _Worker:
        return _Worker(self.fn, self.warm, self.config.memory_mb)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._start()
        self.replaced += 1

    def map(self, args_list: Sequence[tuple]) -> list[tuple[str, Any]]:
        with self._lock:
            return self._map(list(args_list))

    def _map(self, args_list: list[tuple]) -> list[tuple[str, Any]]:
        cfg = self.config
        results: list[tuple[str, Any] | None] = [None] * len(args_list)
        pending = collections.deque(range(len(args_list)))
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    w.task = pending.popleft()
                    w.deadline = now + cfg.timeout_s
                    w.tasks.send((w.task, args_list[w.task]))
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            deadlines = [w.deadline if w.ready else w.started + cfg.start_timeout_s
                         for w in waiting]
            wait([w.conn for w in waiting], timeout=max(0.0, min(deadlines) - now))
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w not in waiting:
                    continue
                try:
                    message = w.conn.recv() if w.conn.poll() else None
                except (EOFError, OSError):     # the worker died (a crash, the memory cap)
                    message = EOFError
                if message == "ready":
                    w.ready = True
                elif isinstance(message, tuple):
                    index, ok, value = message
                    results[index] = (OK, value) if ok else (ERROR, value)
                    w.task = None
                elif message is EOFError or (
                        not w.ready and now >= w.started + cfg.start_timeout_s):
                    if w.task is not None:
                        results[w.task] = (ERROR, f"worker exited with code "
                                                  f"{w.process.poll()}")
                    elif not w.ready:
                        w.kill()
                        raise RuntimeError(f"a verifier worker ({self.fn}) did not start "
                                           f"within {cfg.start_timeout_s} s (exit code "
                                           f"{w.process.returncode}; its stderr says why)")
                    self._replace(i)
                elif w.task is not None and now >= w.deadline:
                    results[w.task] = (TIMEOUT, f"no verdict within {cfg.timeout_s} s")
                    self._replace(i)
        return results

    def close(self) -> None:
        """Ends the workers (killed: they hold nothing to save, and a clean interpreter exit
        with sympy loaded costs more than the kill)."""
        with self._lock:
            for w in self._workers:
                w.kill()
            self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SHARED: dict[tuple, VerifierPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(fn: Callable[..., Any], config: PoolConfig,
                warm: Callable[[], None] | None = None) -> VerifierPool:
    """One pool per (fn, config) for the life of the process: a reward called every step reuses
    its workers instead of paying their start-up each time. Closed at exit."""
    key = (fn, config, warm)
    with _SHARED_LOCK:
        if key not in _SHARED:
            if not _SHARED:
                import atexit

                atexit.register(close_shared_pools)
            _SHARED[key] = VerifierPool(fn, config, warm)
        return _SHARED[key]


def close_shared_pools() -> None:
    with _SHARED_LOCK:
        while _SHARED:
            _SHARED.popitem()[1].close()


if __name__ == "__main__":
    _fn, _warm, _memory, _tasks, _results = sys.argv[1:]
    _serve(Connection(int(_tasks), writable=False), Connection(int(_results), readable=False),
           _function(_fn), _function(_warm) if _warm else None, int(_memory) or None)
