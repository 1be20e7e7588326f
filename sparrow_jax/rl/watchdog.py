"""Ends a run whose step never finishes, so that a supervisor can resume it.

After an error on one device the others can wait in a collective for ever: an out-of-memory on
one of two H100s left the other in NCCL's set-up until the machine was taken back, a hung job
holding a whole host. With ``TrainConfig.step_timeout_s`` set, a thread watches the training
loop: when no step (with its evaluation and checkpoint) has finished for that long, it prints
one line naming the step and the limit, then where every thread is, and ends the process with
status :data:`EXIT_STATUS`. The last checkpoint is intact (checkpoints are written whole or not
at all), so ``sparrow train --resume`` continues from it. The limit must cover the first step's
compilation.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable, TextIO

EXIT_STATUS = 124
"""The process's exit status when the watchdog ends it (as ``timeout(1)``'s)."""


class StepWatchdog:
    """A context: ``beat()`` after each step; more than ``timeout_s`` seconds without one ends
    the process (``exit``, ``os._exit`` unless a test passes its own, with :data:`EXIT_STATUS`).
    ``describe()`` names where the run is for the message (e.g. the step)."""

    def __init__(self, timeout_s: float, *, describe: Callable[[], str] = lambda: "",
                 stream: TextIO | None = None, exit: Callable[[int], None] = os._exit):
        self.timeout_s = float(timeout_s)
        self._describe, self._stream, self._exit = describe, stream, exit
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sparrow-watchdog", daemon=True)

    def beat(self) -> None:
        self._last = time.monotonic()

    def __enter__(self) -> "StepWatchdog":
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        poll = min(5.0, self.timeout_s / 10)
        while not self._done.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                stream = self._stream or sys.stderr
                where = self._describe()
                print(f"sparrow: no step finished in {idle:.0f} s (step_timeout_s="
                      f"{self.timeout_s:g}){'; ' + where if where else ''}; exiting with status "
                      f"{EXIT_STATUS}: resume from the last checkpoint", file=stream, flush=True)
                faulthandler.dump_traceback(file=stream, all_threads=True)
                self._exit(EXIT_STATUS)
                return
