"""Run metrics: one JSON line per step in ``RUN_DIR/metrics.jsonl``, and TensorBoard scalars
in ``RUN_DIR/tb`` (tensorboardX, imported only when asked for).

Steps are 0-based. Resuming at step s (the first step to run again) drops the lines of steps
>= s that the interrupted run wrote after its checkpoint, so the log reads as one run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/inf: write null (a bin with too few tokens has no tail statistic).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True,
                 resume_from: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_from is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] < resume_from]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ImportError("TensorBoard logging needs tensorboardX: pip install "
                                  "tensorboardX (or set tensorboard: false)") from None
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_from)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """``metrics``: name -> number (NaN allowed), written under ``step``."""
        record = {"step": int(step), **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), int(step))
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
