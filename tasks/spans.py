"""Timed spans: a task times its parts with ``with span(name): ...`` and returns its plain result;
the caller that wants the times opens ``recording()`` around the call and reads them from the log.

    caller (flow thread)                        task (the same thread, or a task runner's thread)
    with recording() as log:                    with span("reward/infer"):
        stages.experience(...)                      model_ops.forward(...)
    log["reward/infer"].seconds

The log travels in a context variable: Prefect's ThreadPoolTaskRunner runs each submitted task in a
copy of the submitting thread's context (``contextvars.copy_context``), so the tasks of a phase's
pools, running at once in their own threads, all write to the log their caller opened; the log takes
a lock. A span outside any recording (a task called on its own, in a test) is dropped. As
torchtitan's and verl's ``marked_timer``: the timing never changes what a function returns.

Boundary: timing only; what a span means (a row of metrics/steps.parquet) is the records'
(flows/job/records.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """One timed part: its name, when it began (``time.perf_counter`` of the driver, whose threads
    run the tasks) and how long it took."""

    name: str
    start: float
    seconds: float


@dataclass
class SpanLog:
    """The spans recorded while a ``recording()`` was open, from any thread; one per name."""

    spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def get(self, name: str) -> Span | None:
        """The span called ``name`` (None if none was recorded); two of one name are an error, as the
        caller could not tell which of its task calls each timed."""
        with self._lock:
            found = [s for s in self.spans if s.name == name]
        if len(found) > 1:
            raise ValueError(
                f"{len(found)} spans named {name!r} in one recording; give each timed part its own name"
            )
        return found[0] if found else None

    def __getitem__(self, name: str) -> Span:
        span = self.get(name)
        if span is None:
            with self._lock:
                names = ", ".join(s.name for s in self.spans) or "none"
            raise KeyError(
                f"no span named {name!r} was recorded (recorded: {names}); time it with span({name!r})"
            )
        return span


_LOG: ContextVar[SpanLog | None] = ContextVar("nereus_span_log", default=None)


@contextmanager
def recording() -> Iterator[SpanLog]:
    """A fresh log for the spans of the calls made inside it (and of the tasks they submit)."""
    log = SpanLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


@contextmanager
def span(name: str) -> Iterator[None]:
    """Time the block as ``name`` into the open recording (nothing when none is open). A block that
    raises is not recorded: its step fails."""
    start = time.perf_counter()
    yield
    log = _LOG.get()
    if log is not None:
        log.add(Span(name, start, time.perf_counter() - start))
