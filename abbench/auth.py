"""API keys and TLS for engines behind a key or on another host.

Contract
--------
* A profile names where a key comes from, never the key: ``engine.api_key_env = "VLLM_API_KEY"`` (or an
  arm's ``api_key_env``). :func:`resolve_keys` reads every named variable once, before anything starts; an
  unset or empty variable is an :class:`~abbench.errors.AuthError` naming the variable and the field.
* :class:`Credentials` maps a variable name to its key and gives the headers of a service
  (``Authorization: Bearer <key>``); it is the only holder of key values. :meth:`Credentials.redact`
  replaces every key by ``***`` in any text (a server that echoes the header back in an error body), and
  the runner applies it to every error it records or raises.
* :func:`auth_failure` turns a 401/403 :class:`~abbench.errors.RequestError` into an ``AuthError`` that names
  the variable (or says that no key was sent and which field would send one).
* :func:`fingerprint` is what the run records about authentication: whether a key was used and the names of
  the variables, and the CA bundle path; never a key.
* :func:`tls_verify` is the ``verify`` argument of the run's HTTP client: the profile's ``engine.ca_bundle``
  (an ``ssl.SSLContext`` loaded from it) or the default public CAs.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from abbench.errors import AuthError, RequestError

AUTH_STATUSES = (401, 403)
REDACTED = "***"


class Credentials:
    """Keys by environment-variable name (read once from the environment)."""

    def __init__(self, keys: Mapping[str, str] | None = None) -> None:
        self._keys = dict(keys or {})

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __repr__(self) -> str:  # never the keys
        return f"Credentials({', '.join(sorted(self._keys)) or 'none'})"

    @property
    def names(self) -> list[str]:
        return sorted(self._keys)

    def headers(self, env_name: str | None) -> dict[str, str]:
        """The headers a service whose key is in ``env_name`` gets (empty without a key)."""
        if not env_name:
            return {}
        return {"Authorization": f"Bearer {self._keys[env_name]}"}

    def redact(self, text: str) -> str:
        for key in self._keys.values():
            if key:
                text = text.replace(key, REDACTED)
        return text


def resolve_keys(fields: Iterable[tuple[str, str | None]], environ: Mapping[str, str] | None = None) -> Credentials:
    """``fields``: (profile field, variable name or None) pairs. Every named variable must be set and
    non-empty: :class:`AuthError` naming it otherwise."""
    env = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    for field, name in fields:
        if not name or name in keys:
            continue
        value = env.get(name, "")
        if not value.strip():
            raise AuthError(f"{field} names the environment variable {name}, which is "
                            f"{'empty' if name in env else 'not set'}; export {name}=<the server's API key> "
                            "before the run (the key is never written to the profile or the results)")
        keys[name] = value.strip()
    return Credentials(keys)


def auth_failure(e: RequestError, env_name: str | None, field: str, creds: Credentials) -> AuthError:
    """A clear error for a 401/403 answer (``e.status`` in :data:`AUTH_STATUSES`)."""
    detail = creds.redact(e.detail)
    if env_name:
        return AuthError(f"the server refused the API key from ${env_name} ({field}) with HTTP {e.status}: "
                         f"{detail}; check that {env_name} holds the key the server was started with")
    return AuthError(f"the server requires an API key (HTTP {e.status}): {detail}; set {field} = \"VAR\" in the "
                     "profile and export VAR=<the key>")


def is_auth_failure(e: BaseException) -> bool:
    return isinstance(e, RequestError) and e.status in AUTH_STATUSES


def fingerprint(used: Iterable[str | None], ca_bundle: Path | None) -> dict[str, Any]:
    """What run.json records about authentication: only that a key was used (and from which variables)."""
    names = sorted({n for n in used if n})
    return {"api_key_used": bool(names), "api_key_env": names,
            "ca_bundle": str(ca_bundle) if ca_bundle is not None else None}


@functools.cache
def default_tls_context() -> ssl.SSLContext:
    """The public CAs as httpx trusts them by default (certifi's bundle), as one context per process: httpx builds
    a new one for every client made with ``verify=True`` (~25 ms of loading certificates each), and the health
    checks of a starting service make a client per poll. An SSLContext is safe to share between clients."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def tls_verify(ca_bundle: Path | None) -> ssl.SSLContext:
    """The HTTP client's ``verify``: a context trusting ``ca_bundle`` only, or the default CAs
    (:func:`default_tls_context`)."""
    if ca_bundle is None:
        return default_tls_context()
    try:
        return ssl.create_default_context(cafile=str(ca_bundle))
    except (ssl.SSLError, OSError) as e:
        from abbench.errors import ConfigError

        raise ConfigError(f"engine.ca_bundle: {ca_bundle} is not a usable PEM CA bundle: {e}") from None
