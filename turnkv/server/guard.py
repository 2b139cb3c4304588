"""Checks of a request's headers before anything else runs: Host, Content-Type, Authorization.

**Host** (DNS rebinding). While the server is bound to a loopback address it answers only
``Host`` values naming a loopback host (``localhost``, ``127.x.x.x``, ``[::1]``, with or without
a port), plus those of ``--allowed-hosts`` (``name``, ``name:port``, ``*.domain``, ``*``: any),
as local servers such as Jupyter do: a web page whose name an attacker re-points at 127.0.0.1
sends its own name as the Host and is refused with 403 ``host_not_allowed``. Bound to any other
address (``0.0.0.0``, a LAN address) the names clients use are not known in advance, so without
``--allowed-hosts`` every Host is answered; set it (or ``--api-key``) on a reachable server.

**Content-Type.** The JSON routes take only ``application/json`` (a ``charset`` parameter, if
any, must be UTF-8): a browser sends a cross-origin POST without asking first only with
``text/plain``, form or multipart bodies, so these get 415 and never start a generation.

**Authorization.** ``Bearer KEY``, or ``x-api-key: KEY`` as Anthropic's clients send it; only
HTTP's own spaces and tabs are trimmed (``str.strip`` would also drop a no-break space or NEL and
let a wrapped key match), the key is compared in constant time, and two ``Authorization`` (or
``x-api-key``) headers are a 400 rather than the first one winning.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, MutableMapping

from fastapi.responses import JSONResponse

from turnkv.server.schemas import ApiError

LOOPBACK_NAMES = ("localhost",)
OWS = b" \t"  # the whitespace HTTP trims around a value (RFC 9110 5.6.3)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is a loopback one."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, str]:
    """A ``Host`` value as (host, port); the port is '' when absent; IPv6 keeps its brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value.partition("]")
        return host + "]", rest.removeprefix(":")
    host, _, port = value.partition(":")
    return host, port


class HostPolicy:
    """Which ``Host`` values a server answers; ``allowed`` is ``EngineConfig.allowed_hosts``."""

    def __init__(self, bind_host: str, allowed: list[str]) -> None:
        self.any = "*" in allowed or (not allowed and not is_loopback(bind_host))
        self.allowed = [a for a in allowed if a != "*"]

    def allows(self, value: str | None) -> bool:
        if self.any:
            return True
        if not value:
            return False
        host, port = split_host(value)
        if is_loopback(host):
            return True
        full = f"{host}:{port}" if port else host
        for pattern in self.allowed:
            if pattern.startswith("*."):
                if host.endswith(pattern[1:]):
                    return True
            elif pattern in (host, full):
                return True
        return False


def _values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in headers if k == name]


def single(headers: list[tuple[bytes, bytes]], name: bytes, label: str) -> bytes | None:
    """The one value of header ``name``, None when absent; a 400 when it is sent twice."""
    found = _values(headers, name)
    if len(found) > 1:
        raise ApiError(
            400, f"send one {label} header (this request has {len(found)})", code="duplicate_header"
        )
    return found[0] if found else None


def host_refused(value: bytes | None) -> ApiError:
    shown = value.decode("latin-1")[:100] if value is not None else None
    return ApiError(
        403,
        f"Host {shown!r} is not allowed: this server answers loopback names (localhost, 127.0.0.1, [::1]) "
        "and the names of --allowed-hosts (e.g. --allowed-hosts my.host.example, or * for any)",
        code="host_not_allowed",
    )


class HostGuard:
    """Pure ASGI middleware refusing a request whose ``Host`` the policy does not allow (403 in the
    OpenAI shape; two Host headers: 400). ``count(scope, status)`` counts each refusal."""

    def __init__(self, app, policy: HostPolicy, count: Callable[[MutableMapping, int], None]) -> None:
        self.app = app
        self.policy = policy
        self.count = count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.policy.any:
            await self.app(scope, receive, send)
            return
        try:
            value = single(scope["headers"], b"host", "Host")
            if not self.policy.allows(value.decode("latin-1") if value is not None else None):
                raise host_refused(value)
        except ApiError as e:
            self.count(scope, e.status)
            await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def require_json(headers: list[tuple[bytes, bytes]]) -> None:
    """415 unless the body is declared ``application/json`` (charset, if given, UTF-8)."""
    value = single(headers, b"content-type", "Content-Type")
    text = value.decode("latin-1") if value is not None else ""
    media, *params = (p.strip().lower() for p in text.split(";"))
    charset = next((p.split("=", 1)[1].strip('" ') for p in params if p.startswith("charset=")), "utf-8")
    if media != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(
            415,
            f"Content-Type must be application/json (optionally with charset=utf-8); got {text[:100]!r}",
            code="unsupported_media_type",
        )


def bearer_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The bearer token of the request's one Authorization header (b'' when there is none);
    only spaces and tabs around it are trimmed."""
    value = single(headers, b"authorization", "Authorization") or b""
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
        return b""
    return token.strip(OWS)


def request_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key a request presents: its bearer token, else its one ``x-api-key`` header (b'': none)."""
    token = bearer_key(headers)
    if token:
        return token
    return (single(headers, b"x-api-key", "x-api-key") or b"").strip(OWS)


def matching_key(token: bytes, keys: set[str]) -> str | None:
    """The configured key equal to ``token`` (every key compared in constant time), else None."""
    found = None
    for key in keys:
        if hmac.compare_digest(token, key.encode()):
            found = key
    return found
