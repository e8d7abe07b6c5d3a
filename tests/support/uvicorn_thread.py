"""An ASGI app served by a real uvicorn server on a free loopback port, in a daemon thread (engine tests)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    """Serve ``app`` with uvicorn on a free loopback port in a daemon thread; ``url`` is its base URL."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
