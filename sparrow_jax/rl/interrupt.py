"""SIGINT and SIGTERM as a stop at the trainer's next safe point.

Spot GPUs and TPU VMs are preempted with SIGTERM and ~30 s of notice, too little to finish a
long rollout. So the part of a step before the update (rollout, rewards, recompute) is
*abandonable*: a signal there abandons the step at once (the model and optimizer state are
untouched until the update) and the trainer saves the state from before it. A signal during the
update, an evaluation's bookkeeping or a save lets that finish first. A second SIGINT exits at
once without saving.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StepAbandoned(BaseException):
    """Raised inside an abandonable phase when a stop signal arrives. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a checkpoint from which ``--resume``
    continues exactly."""

    def __init__(self, signum: int, step: int, checkpoint_dir: str):
        self.signum, self.step, self.checkpoint_dir = signum, step, checkpoint_dir
        super().__init__(f"interrupted by {signal.Signals(signum).name} before step {step}; "
                         f"saved checkpoint {step} in {checkpoint_dir}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Context manager: while active (main thread only), SIGINT/SIGTERM set :attr:`signum`
    and, inside :meth:`abandonable`, raise :class:`StepAbandoned`."""

    def __init__(self):
        self.signum: int | None = None
        self._abandonable = False
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            print("second interrupt: exiting at once, nothing saved", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"{signal.Signals(signum).name}: stopping at the next safe point (interrupt again "
              "to exit at once, without saving)", file=sys.stderr, flush=True)
        if self._abandonable:
            raise StepAbandoned()

    @contextlib.contextmanager
    def abandonable(self):
        """A phase that a stop signal abandons (also one that arrived just before it)."""
        self._abandonable = True
        try:
            if self.signum is not None:
                raise StepAbandoned()
            yield
        finally:
            self._abandonable = False
