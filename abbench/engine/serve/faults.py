"""Fault injection for tests, outside the engine: a served backend wrapped so that one request fails the way a
failed CUDA allocation does.

The launcher reads ``ABBENCH_ENGINE_FAULT`` once, before it builds the vendored engine (:func:`armed`: an unknown
value refuses to start, ``ValueError``), and serves the engine through :class:`InjectFaults`. ``oom-once``: the
next request's second cancel check, inside prefill's layer loop (every layer step checks; a model of two or more
layers gets there), raises ``torch.OutOfMemoryError``, so the engine's OOM path (request-local tensors released,
the error propagated, the engine usable) and the server's 503 run for real on any device; the next request is
served. Unset in normal use, where the launcher serves the engine itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from abbench.engine.contract import Backend, BackendInfo, CancelLike, GenerateRequest, Scheduler, TokenEvent

__all__ = ["FAULTS", "FAULT_ENV", "InjectFaults", "armed"]

FAULT_ENV = "ABBENCH_ENGINE_FAULT"
FAULTS = ("oom-once",)


def armed(environ: Mapping[str, str] = os.environ) -> str | None:
    """The fault ``environ`` arms, or None; ValueError for an unknown one."""
    fault = environ.get(FAULT_ENV, "")
    if fault and fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r}: unknown fault (known: {', '.join(FAULTS)}); unset it")
    return fault or None


class _OomAtSecondCheck:
    """A request's cancel flag that raises torch.OutOfMemoryError at its second check, then defers to ``inner``."""

    def __init__(self, inner: CancelLike, fired: Any):
        self.inner, self.fired, self.checks = inner, fired, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks == 2 and not self.fired():
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAULT_ENV}=oom-once at prefill "
                                         f"layer step {self.checks})")
        if self.inner is None:
            return False
        return self.inner.is_set() if hasattr(self.inner, "is_set") else bool(self.inner())


class InjectFaults:
    """``backend`` with ``fault`` armed (module docstring); every other call goes straight through."""

    def __init__(self, backend: Backend, fault: str):
        self.backend, self.fault = backend, fault

    @property
    def info(self) -> BackendInfo:
        return self.backend.info

    @property
    def counters(self) -> dict[str, Any]:
        return self.backend.counters

    def _fired(self) -> bool:
        """Whether the fault has fired; the first call that finds it armed disarms it (that check raises)."""
        if self.fault == "oom-once":
            self.fault = None
            return False
        return True

    def generate(self, request: GenerateRequest, cancel: CancelLike = None) -> Iterator[TokenEvent]:
        if self.fault is None:
            return self.backend.generate(request, cancel)
        return self.backend.generate(request, _OomAtSecondCheck(cancel, self._fired))

    def reset(self) -> None:
        self.backend.reset()

    @property
    def scheduler(self) -> Scheduler:
        return _FaultyScheduler(self.backend.scheduler, self)


class _FaultyScheduler:
    """The backend's scheduler, with the fault armed in the cancel flag of the requests it is given."""

    def __init__(self, inner: Scheduler, faults: InjectFaults):
        self.inner, self.faults = inner, faults

    def submit(self, request: GenerateRequest, cancel: CancelLike, emit: Any) -> Any:
        if self.faults.fault is not None:
            cancel = _OomAtSecondCheck(cancel, self.faults._fired)
        return self.inner.submit(request, cancel, emit)

    def __getattr__(self, name: str) -> Any:  # step, busy, free, waiting, running, abort, fail_all
        return getattr(self.inner, name)
