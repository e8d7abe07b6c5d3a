"""One exception tree for the harness. The CLI catches :class:`AbbenchError` and maps it to an exit code;
nothing else in the harness prints to the terminal or exits.

::

    AbbenchError                      exit 2 unless a subclass says otherwise
    ├── ConfigError                   bad profile, flag or tokenizer path (names the field and the fix)
    ├── PromptError                   an exact-length prompt cannot be built or checked
    ├── ServiceError                  an engine service failed to start, died or could not be reached
    │   ├── HealthTimeout             never became healthy; carries the tail of its log
    │   └── PortTaken                 another process took a launched service's port as it started
    ├── RequestError                  one request failed; ``kind`` says how (http, sse, timeout, usage, ...)
    ├── AuthError                     the server refused the API key (401/403) or the key's variable is unset
    ├── ResultsError                  a results directory is missing, corrupt or of another schema
    └── GateFailed                    exit 1: parity or a declared check failed (the gate's verdict)

Lower-level errors (httpx, OSError, pydantic.ValidationError, tomllib) are mapped to these at the module
boundary where they happen, with the context a user needs (file, field, arm, prompt).
"""

from __future__ import annotations


class AbbenchError(Exception):
    """Base of every error the harness raises on purpose."""

    exit_code: int = 2


class ConfigError(AbbenchError):
    """A profile, CLI flag or tokenizer source is invalid. The message names the field and what is allowed."""


class PromptError(AbbenchError):
    """An exact-length prompt could not be built, or did not round-trip to the same token ids."""


class ServiceError(AbbenchError):
    """An engine service could not be launched, died, or did not answer."""

    def __init__(self, message: str, *, log_tail: str | None = None) -> None:
        if log_tail:
            message = f"{message}\n--- last lines of the service log ---\n{log_tail.rstrip()}"
        super().__init__(message)
        self.log_tail = log_tail


class HealthTimeout(ServiceError):
    """The service did not report healthy within its timeout."""


class PortTaken(ServiceError):
    """Another process, running before the service was launched, listened on its port and answered its health
    check, and the service itself could not bind the port (it exited)."""


class RequestError(AbbenchError):
    """One request failed. ``kind`` is a short machine-readable reason recorded with the sample:
    ``http`` (4xx/5xx), ``connect``, ``timeout``, ``sse`` (malformed stream), ``no-done`` (stream ended without
    ``[DONE]``), ``finish-reason``, ``usage`` (prompt_tokens differs from the target), ``protocol`` (a body
    that is not the expected shape), ``cancelled``."""

    def __init__(self, kind: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.detail = message
        self.status = status


class AuthError(AbbenchError):
    """The server answered 401/403, or the environment variable a profile names for the API key is unset. The
    message names the variable (``engine.api_key_env`` or an arm's), never the key. It stops the run at once:
    every other request would be refused the same way."""


class ResultsError(AbbenchError):
    """A results directory or file is missing, corrupt, partial where completeness is needed, or of an
    unknown schema version."""


class GateFailed(AbbenchError):
    """The gate's verdict is 'fail'. Exit code 1 so CI can tell it from a usage error (2)."""

    exit_code = 1
