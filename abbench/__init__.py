"""abbench: rigorous A/B validation of inference-engine changes.

The harness (everything outside ``abbench.engine``) builds exact-length prompts, drives engine services
arm by arm in interleaved reversed-order rounds, checks greedy parity and writes JSON + Markdown reports.
``abbench.engine`` is a vendored offloaded-MoE engine driven over HTTP like any other engine; it imports
nothing from the harness.
"""

__version__ = "0.1.0"
