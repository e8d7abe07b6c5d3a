"""What the peers' launch commands (``python -m abbench.peers.llamacpp_serve`` / ``vllm_serve``) share: their own
options come first, then ``--`` and the arguments passed through to the server unchanged.
"""

from __future__ import annotations

import argparse
from typing import Any


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the wrapper's own arguments, the server's) around the first ``--``."""
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1:]
    return argv, []


def parse_recorded(argv: list[str], module: str, parser: argparse.ArgumentParser) -> tuple[argparse.Namespace | None,
                                                                                          dict[str, Any] | None]:
    """A recorded service command's wrapper options (``argv`` holds ``module``): (namespace, None), or (None,
    the error a fingerprint records) when they do not parse."""
    own, _ = split_passthrough(argv[argv.index(module) + 1:])
    try:
        return parser.parse_args(own), None
    except SystemExit:
        return None, {"error": f"unparsable {module} arguments: {own}"}
