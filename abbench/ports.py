"""Ports and hosts, for launching and attaching to services: a free port, whether a port is in use (and by
whom, where psutil may see it), how a URL reaches a server bound on a host, and why nothing answers at a base
URL (:func:`unreachable`: a host that does not resolve, a port that refuses connections). No HTTP here.
"""

from __future__ import annotations

import errno
import socket
import urllib.parse

import psutil

from abbench.errors import ConfigError

__all__ = ["describe_pid", "free_port", "listening_pids", "port_in_use", "port_owner", "unreachable", "url_host"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bind to port 0 and ask the kernel)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _connect_host(host: str) -> str:
    """Where a client reaches a server bound on ``host`` (wildcards map to loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def url_host(host: str) -> str:
    """``host`` as the host part of a URL that reaches a server bound on it (IPv6 in brackets)."""
    h = _connect_host(host)
    return f"[{h}]" if ":" in h else h


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port`` or the port cannot be bound there.

    Two checks: a connect (anything accepting -> in use), then a bind with SO_REUSEADDR, as servers do
    (fails while another socket listens on the port, but not for leftover TIME_WAIT connections)."""
    chost = _connect_host(host)
    family = socket.AF_INET6 if ":" in chost else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            if s.connect_ex((chost, port)) == 0:
                return True
        except OSError:
            pass
    bfamily = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(bfamily, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def listening_pids(port: int) -> set[int] | None:
    """The pids of the processes listening on TCP ``port`` (any address) that psutil may see (on Linux, the
    user's own); None when it may not list sockets at all."""
    try:
        return {c.pid for c in psutil.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    except (psutil.Error, OSError):
        return None


def describe_pid(pid: int) -> str:
    """'pid N (name)', or 'pid N' where the name cannot be read."""
    try:
        return f"pid {pid} ({psutil.Process(pid).name()})"
    except psutil.Error:
        return f"pid {pid}"


def port_owner(port: int) -> str | None:
    """'pid N (name)' of the process listening on ``port``, when psutil may see it (often needs root)."""
    pids = listening_pids(port)
    return describe_pid(min(pids)) if pids else None


def _host_port(base_url: str) -> tuple[str, int]:
    """The host and TCP port a ``base_url`` connects to (the scheme's port when none is given)."""
    u = urllib.parse.urlsplit(base_url)
    try:
        port = u.port
    except ValueError:
        raise ConfigError(f"base_url {base_url!r}: the port is not a number") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"base_url {base_url!r}: expected http://HOST:PORT or https://HOST:PORT")
    return u.hostname, port or (443 if u.scheme == "https" else 80)


def unreachable(base_url: str) -> str | None:
    """Why nothing can answer at ``base_url`` right now ("cannot resolve ...", "connection refused at ..."),
    or None when its port accepts a TCP connection (or the attempt only timed out: a busy host may yet answer).
    Direct connections, as the client makes them (no proxy)."""
    host, port = _host_port(base_url)
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve host {host!r} of {base_url} ({e.strerror or e})"
    refused = ""
    for family, kind, proto, _, addr in addrs:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(1.0)
            try:
                s.connect(addr)
                return None
            except ConnectionRefusedError:
                refused = f"connection refused at {base_url}: nothing listens on {host} port {port}"
            except OSError as e:
                if isinstance(e, TimeoutError):
                    return None
                refused = refused or f"cannot connect to {base_url} ({e.strerror or e})"
    return refused or None
