"""Run the vendored engine's server under a Python audit hook that records every file it opens whose path
contains a marker, so a test can assert that no request made the server open a file it named.

    python tests/support/engine_audit.py --audit-log FILE --audit-marker TEXT -- [engine server arguments]

The hook (``sys.addaudithook``) sees the ``open`` event of ``open()``/``io.open``/``os.open`` in every
thread; each matching path is appended to ``--audit-log`` as one line. Right after installing the hook the
wrapper opens ``<marker>/probe`` itself (created if missing), so the log's first line proves the hook works.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--audit-log", required=True)
    ap.add_argument("--audit-marker", required=True)
    ap.add_argument("engine_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    marker = a.audit_marker
    lock = threading.Lock()
    log = open(a.audit_log, "a", buffering=1, encoding="utf-8")  # opened before the hook: not logged

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not args or isinstance(args[0], int):  # an int: os.fdopen of a descriptor
            return
        try:
            path = os.fsdecode(args[0])
        except TypeError:
            return
        if marker in path:
            with lock:
                log.write(path + "\n")

    sys.addaudithook(hook)
    os.makedirs(marker, exist_ok=True)
    with open(os.path.join(marker, "probe"), "a"):
        pass
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from abbench.engine.serve.launch import main as serve

    args = a.engine_args[1:] if a.engine_args[:1] == ["--"] else a.engine_args
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
