"""A tiny HTTP service for the services/telemetry tests (standard library only).

    python tests/support/svc_helper.py --port N [--delay S] [--never-healthy] [--exit-early CODE]
                               [--children K] [--setsid-grandchild] [--pidfile F] [--ignore-sigterm]
                               [--alloc-mb M] [--say TEXT]

Serves ``GET /health`` (200, or 503 with --never-healthy) and ``GET /metrics`` (a Prometheus counter) on
127.0.0.1:N after ``--delay`` seconds. ``--children K`` spawns K sleeping children; each spawns a sleeping
grandchild (with --setsid-grandchild the grandchild leaves the process group). Pids of the whole tree go to
``--pidfile`` (one per line) once everything is spawned.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import time

SLEEPER = "import time\nwhile True: time.sleep(1)\n"


def spawn_child(setsid_grandchild: bool, alloc_mb: int) -> tuple[subprocess.Popen[bytes], int]:
    """A child that spawns a grandchild, prints the grandchild's pid, then sleeps."""
    code = (
        "import subprocess, sys, time\n"
        f"g = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session={setsid_grandchild})\n"
        f"buf = bytearray({alloc_mb} * 1024 * 1024)\n"
        "for i in range(0, len(buf), 4096): buf[i] = 1\n"
        "print(g.pid, flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None
    gpid = int(p.stdout.readline())
    return p, gpid


class Handler(http.server.BaseHTTPRequestHandler):
    never_healthy = False
    hits = 0

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            code = 503 if self.never_healthy else 200
            body = b"not ready\n" if self.never_healthy else b"ok\n"
        elif self.path == "/metrics":
            Handler.hits += 1
            code = 200
            body = (
                "# HELP helper_requests_total Requests.\n# TYPE helper_requests_total counter\n"
                f'helper_requests_total{{path="/metrics"}} {Handler.hits}\n'
            ).encode()
        else:
            code, body = 404, b"no\n"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        print("request:", fmt % args, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--never-healthy", action="store_true")
    ap.add_argument("--exit-early", type=int, default=None)
    ap.add_argument("--children", type=int, default=0)
    ap.add_argument("--setsid-grandchild", action="store_true")
    ap.add_argument("--pidfile", default=None)
    ap.add_argument("--ignore-sigterm", action="store_true")
    ap.add_argument("--alloc-mb", type=int, default=0)
    ap.add_argument("--say", default="helper starting")
    a = ap.parse_args()

    print(a.say, "pid", os.getpid(), "env", os.environ.get("SVC_HELPER_ENV", "-"), flush=True)
    sys.stderr.write("helper stderr line\n")
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.exit_early is not None:
        print(f"helper exiting early with {a.exit_early}", flush=True)
        return a.exit_early

    pids = [os.getpid()]
    for _ in range(a.children):
        child, gpid = spawn_child(a.setsid_grandchild, a.alloc_mb)
        pids += [child.pid, gpid]
    if a.pidfile:
        tmp = a.pidfile + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(map(str, pids)) + "\n")
        os.replace(tmp, a.pidfile)

    time.sleep(a.delay)
    Handler.never_healthy = a.never_healthy
    server = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    print("helper listening on", a.port, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
