"""Incremental server-sent-events parser: raw bytes in, dispatched events out.

Events may be split across network chunks; ``\\r\\n``, ``\\n`` and ``\\r`` line ends, comments and multi-line
``data`` are handled as the SSE specification says. Anything that is not an SSE field, bytes that are not
UTF-8, and a last event cut off before its blank line raise ``RequestError('sse')``.
"""

from __future__ import annotations

from dataclasses import dataclass

from abbench.errors import RequestError

SNIPPET = 200
"""Characters of offending data quoted in a message."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched server-sent event: its ``data`` lines joined with ``\\n``."""

    data: str
    event: str | None = None
    id: str | None = None


class SSEParser:
    """Incremental ``text/event-stream`` parser (WHATWG HTML, "Parsing an event stream"), strict about junk.

    ``feed(chunk)`` takes raw bytes as they arrive and returns the events completed by them. Lines end with
    ``\\r\\n``, ``\\n`` or ``\\r``; a ``\\r`` at the end of a chunk ends its line at once (a ``\\n`` opening the
    next chunk is then skipped), so no event waits for the next chunk. Comments (``:...``), ``id``, ``event``
    and ``retry`` lines are accepted; any other line raises ``RequestError('sse')`` (OpenAI-compatible servers
    send nothing else, so anything else is a broken stream). After the stream, :meth:`close` raises
    ``RequestError('sse')`` when a last event was cut off before its blank line.
    """

    __slots__ = ("_pending", "_skip_lf", "_data", "_event", "_id", "_at_start", "events")

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # bytes of an unfinished line
        self._skip_lf = False  # the previous chunk ended with a lone \r
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._at_start = True  # a UTF-8 BOM may open the stream
        self.events = 0  # events dispatched so far

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if not chunk:
            return []
        if b"\n" not in chunk and b"\r" not in chunk:
            self._pending.append(chunk)
            return []
        if self._pending:
            self._pending.append(chunk)
            chunk = b"".join(self._pending)
            self._pending = []
        if self._at_start:
            self._at_start = False
            if chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
        lines = chunk.splitlines(keepends=True)  # bytes.splitlines splits on \r\n, \n and \r only
        last = lines[-1]
        if last.endswith(b"\r"):
            self._skip_lf = True
        elif not last.endswith(b"\n"):
            self._pending.append(lines.pop())
        out: list[SSEEvent] = []
        for raw in lines:
            self._line(raw.rstrip(b"\r\n"), out)
        return out

    def close(self) -> None:
        """Call at the end of the stream: raises if an event was left without its terminating blank line."""
        leftover = b"".join(self._pending)
        if leftover or self._data:
            cut = leftover.decode("utf-8", "replace") if leftover else "data: " + "\n".join(self._data)
            raise RequestError(
                "sse", f"the stream ended in the middle of an event (no blank line after it): {cut[:SNIPPET]!r}"
            )

    def _line(self, line: bytes, out: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                out.append(SSEEvent("\n".join(self._data), self._event, self._id))
                self.events += 1
                self._data = []
            self._event = None
            return
        if line[0] == 0x3A:  # ":" comment (keep-alive)
            return
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("sse", f"a line of the event stream is not UTF-8: {line[:SNIPPET]!r}") from None
        name, _, value = text.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        elif name != "retry":
            raise RequestError("sse", f"unexpected line in the event stream: {text[:SNIPPET]!r}")
