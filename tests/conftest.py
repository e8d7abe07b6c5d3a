"""Shared test setup.

Layout: ``tests/harness/`` tests the harness (everything outside ``abbench.engine``), ``tests/engine/`` the
vendored engine, and ``tests/support/`` holds what tests use but are not tests themselves: fake engines and
servers on loopback, the fault kit, helper processes. Tests import the support modules as a package
(``from tests.support import fake_engines``); this file makes the repository root importable for that,
wherever pytest is started from (``pyproject.toml`` sets ``pythonpath = ["."]`` for the usual case).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
