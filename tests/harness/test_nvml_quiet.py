"""NVML's absence on a CPU machine is said at debug level only (and recorded in the fingerprint's
``nvml.reason``); a driver that is there but fails to initialise is a warning."""

from __future__ import annotations

import logging

import pytest

from abbench import nvml


def _session(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> nvml.NvmlSession:
    pynvml = pytest.importorskip("pynvml")

    def fail() -> None:
        raise error

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    return nvml.NvmlSession()


def test_no_driver_is_silent_at_the_default_level(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    import pynvml

    for code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
        caplog.clear()
        s = _session(monkeypatch, pynvml.NVMLError(code))
        with caplog.at_level(logging.DEBUG, logger="abbench.nvml"):
            assert s.ensure() is False and s.ensure() is False
        assert [r.levelno for r in caplog.records] == [logging.DEBUG], caplog.records
        assert "NVML could not be initialised" in (s.reason or "")


def test_a_failing_driver_is_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import pynvml

    s = _session(monkeypatch, pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN))
    with caplog.at_level(logging.DEBUG, logger="abbench.nvml"):
        assert s.ensure() is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
