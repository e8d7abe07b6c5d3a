"""Test support: fake engines and servers on loopback, the fault kit, helper processes (not tests).

Modules that also run as scripts (``python tests/support/fakeserver.py ...``) are addressed by path; these
constants say where they are.
"""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""This folder (the scripts' location)."""
REPO = SUPPORT.parents[1]
"""The repository root."""
