"""Step telemetry from inside a training job: one step record per rank per step.

The record is DESIGN.md's training step (`fleetwise.schemas.TrainingStep`), on
`fleetwise.telemetry.steps` keyed by job. Records go through a bounded buffer to a background
thread that publishes them, so a slow or absent broker never slows a step: when the buffer is
full the oldest record is dropped and counted (`StepReporter.dropped`).

`compute_s` is measured without a barrier around forward + backward (`ComputeTimer`): on CPU
with `time.perf_counter`; on CUDA with events read one step later, when they have completed,
so the timer never synchronises the device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fleetwise.schemas import TrainingStep
from fleetwise.schemas import topics as T

__all__ = ["ComputeTimer", "Outbox", "StepReporter", "gpu_model"]


def gpu_model(device: Any = None) -> str | None:
    """The GPU's name as the driver reports it (e.g. "NVIDIA H100 80GB HBM3"); None on CPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the train extra is not installed
        return None
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(device))


class ComputeTimer:
    """Barrier-free timing of forward + backward: `with timer: ...; timer.last_s`.

    On CUDA (`cuda=True`) it records events around the block and resolves the previous
    block's time when its end event has completed (`Event.query`), never by synchronising;
    `last_s` is then one step late, and None until a first block has completed.
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.last_s: float | None = None
        self._t0 = 0.0
        self._pending: list[tuple[Any, Any]] = []

    def __enter__(self) -> ComputeTimer:
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending.append((start, None))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.cuda:
            self.last_s = time.perf_counter() - self._t0
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending[-1] = (self._pending[-1][0], end)
        while self._pending and self._pending[0][1] is not None and self._pending[0][1].query():
            start, done = self._pending.pop(0)
            self.last_s = start.elapsed_time(done) / 1000.0


class Outbox:
    """Records published from a background thread through a bounded buffer (drop-oldest).

    `publish(topic, key, record)` is a transport's (`fleetwise.training.transport`); it may
    block or raise: a failed send is counted in `errors` and the record dropped, and the
    caller never waits for it. `capacity`: records held at most; beyond it the oldest is
    dropped and counted in `dropped`.
    """

    def __init__(self, publish: Callable[[str, str, Any], None], *, capacity: int = 1024,
                 name: str = "fleetwise-outbox", interval_s: float = 0.02) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._publish = publish
        # The thread wakes every `interval_s` (or when a quarter of the buffer is used), not on
        # every record: the training thread pays no thread switch per step.
        self.interval_s = interval_s
        self._wake_at = max(1, capacity // 4)
        self._buffer: deque[tuple[str, str, Any]] = deque(maxlen=capacity)
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, topic: str, key: str, record: Any) -> None:
        """Queue one record (never blocks; drops the oldest queued record when full)."""
        with self._cond:
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1  # deque(maxlen) drops the oldest on append
            self._buffer.append((topic, key, record))
            if len(self._buffer) >= self._wake_at:
                self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._buffer) + self._busy

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._buffer and not self._closed:
                    self._cond.wait(self.interval_s)
                if not self._buffer and self._closed:
                    return
                item = self._buffer.popleft()
                self._busy = True
            try:
                self._publish(*item)
                self.sent += 1
            except Exception as exc:  # a broken bus must not stop telemetry or training
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued records are sent (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify_all()
            while self._buffer or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Send what is queued (up to `timeout_s`) and stop the thread."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s if done else 0.1)
        return done


class StepReporter:
    """This rank's step records (`fleetwise.telemetry.steps`, key job) through an `Outbox`."""

    def __init__(
        self,
        publish: Callable[[str, str, Any], None],
        *,
        job: str,
        rank: int,
        node: str,
        gpu: int = 0,
        model: str | None = None,
        capacity: int = 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.job, self.rank, self.node, self.gpu, self.model = job, rank, node, gpu, model
        self.clock = clock
        self.outbox = Outbox(publish, capacity=capacity, name=f"fleetwise-steps-{rank}")

    def record(self, step: int, step_time_s: float, compute_s: float, *, micro_batch: int | None = None,
               samples: int | None = None, ts: float | None = None) -> TrainingStep:
        """Queue one step's record (never blocks)."""
        step_time_s = max(step_time_s, 1e-9)
        rec = TrainingStep.model_construct(
            ts=self.clock() if ts is None else ts, job=self.job, rank=self.rank, node=self.node, gpu=self.gpu,
            step=step, step_time_s=step_time_s, compute_s=min(max(compute_s, 0.0), step_time_s * 1.5),
            micro_batch=micro_batch, samples=samples, model=self.model,
        )
        self.outbox.put(T.TELEMETRY_STEPS.name, self.job, rec)
        return rec

    @property
    def dropped(self) -> int:
        return self.outbox.dropped

    @property
    def sent(self) -> int:
        return self.outbox.sent

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.outbox.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> bool:
        return self.outbox.close(timeout_s)
