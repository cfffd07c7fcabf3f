"""Who may use the gateway: API keys (stored hashed), short-lived signed tokens, an Origin check.

Keys look like `ck_<id>_<secret>`; only a salted PBKDF2-SHA256 hash of each is configured, as a
line `<id>:pbkdf2_sha256$<iterations>$<salt hex>$<hash hex>` in a keys file (`#` comments) or in
the CADENCE_API_KEYS environment variable (comma-separated). `python -m gateway.auth new NAME`
prints a fresh key and its line. The id in a presented key selects the one hash to check, so a
wrong key costs one hash; verified keys are remembered (in memory, by SHA-256) so a client does not
pay the hash on every request.

Tokens (`POST /v1/tokens`, for browsers): `base64url(payload).base64url(HMAC-SHA256(payload))`,
the payload naming the key id, the voices the token may use (null = any) and the expiry. The
signing secret is CADENCE_TOKEN_SECRET (several instances must share it) or random per process.

Where: `Authorization: Bearer <key or token>` on REST and WebSocket; `?token=` on WebSocket only
(a key in a URL ends up in logs). For the compatible dialects (gateway.compat) the same keys and
tokens also come as their vendors send them: `Authorization: Api-Key <key>` (Baseten),
`xi-api-key` (ElevenLabs), `X-API-Key` (Cartesia), and on WebSocket `?api_key=` / `?access_token=`
(Cartesia); an ElevenLabs socket without any may authenticate in its first message instead, and
Twilio's media stream (`/v1/twilio`) in its `start` message's `token` parameter. Browser WebSockets (an `Origin` header) must come from an allowed
origin: the configured list, or the gateway's own origin (the demo page). With no keys configured
everything is open to an anonymous principal, and the server binds loopback only (gateway.server).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

PBKDF2_ITERATIONS = 200_000
KEY_PREFIX = "ck_"
MAX_TOKEN_TTL_S = 24 * 3600
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


class AuthError(Exception):
    """Credentials missing, wrong, expired, or not allowed here."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key id (quotas are per key) and the voices allowed (None = any)."""

    key_id: str
    voices: frozenset[str] | None = None
    via_token: bool = False

    def may_use_voice(self, voice: str | None) -> bool:
        """The engine default (None) is always allowed; a scoped token allows only its voices."""
        return voice is None or self.voices is None or voice in self.voices

    def may_change_voices(self) -> bool:
        """Whether it may clone (register a voice, or speak one-off from a reference clip) and
        delete voices: a clone is a voice outside any list, so a voice-scoped token, which reads
        and speaks its key's voices, changes none; a key, or a token without a list, may."""
        return self.voices is None


ANONYMOUS = Principal("anonymous")


@dataclass(frozen=True, slots=True)
class StoredKey:
    key_id: str
    iterations: int
    salt: bytes
    digest: bytes

    def line(self) -> str:
        return f"{self.key_id}:pbkdf2_sha256${self.iterations}${self.salt.hex()}${self.digest.hex()}"


def _hash(secret: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)


def new_key(key_id: str, iterations: int = PBKDF2_ITERATIONS) -> tuple[str, StoredKey]:
    """A fresh key (shown once) and the hashed form to configure."""
    if not key_id or not set(key_id) <= _ID_CHARS or len(key_id) > 64:
        raise ValueError("a key id is 1-64 letters, digits or '-'")
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(24)}"
    salt = secrets.token_bytes(16)
    return key, StoredKey(key_id, iterations, salt, _hash(key, salt, iterations))


def parse_key_line(line: str) -> StoredKey:
    try:
        key_id, rest = line.strip().split(":", 1)
        scheme, iterations, salt, digest = rest.split("$")
        if scheme != "pbkdf2_sha256" or not key_id or not set(key_id) <= _ID_CHARS:
            raise ValueError
        return StoredKey(key_id, int(iterations), bytes.fromhex(salt), bytes.fromhex(digest))
    except ValueError:
        raise ValueError("a key line is <id>:pbkdf2_sha256$<iterations>$<salt hex>$<hash hex>") from None


def _key_id_of(presented: str) -> str | None:
    if not presented.startswith(KEY_PREFIX):
        return None
    key_id, sep, _ = presented[len(KEY_PREFIX) :].partition("_")  # ids hold no "_"; secrets may
    return key_id if sep and key_id else None


class KeyStore:
    def __init__(self, keys: Iterable[StoredKey] = (), cache_size: int = 1024) -> None:
        self._keys = {k.key_id: k for k in keys}
        self._verified: OrderedDict[bytes, str] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def load(cls, path: str | None = None, env_value: str | None = None) -> KeyStore:
        """Keys from a file (one line each) and/or an environment value (comma-separated)."""
        lines: list[str] = []
        if path:
            lines += Path(path).read_text().splitlines()
        if env_value:
            lines += env_value.split(",")
        return cls(
            parse_key_line(line) for line in lines if line.strip() and not line.lstrip().startswith("#")
        )

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def verify(self, presented: str) -> Principal:
        fingerprint = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        known = self._verified.get(fingerprint)
        if known is not None and known in self._keys:
            self._verified.move_to_end(fingerprint)
            return Principal(known)
        key_id = _key_id_of(presented)
        stored = self._keys.get(key_id) if key_id else None
        if stored is None or len(presented) > 256:
            raise AuthError("invalid API key")
        if not hmac.compare_digest(_hash(presented, stored.salt, stored.iterations), stored.digest):
            raise AuthError("invalid API key")
        self._verified[fingerprint] = stored.key_id
        while len(self._verified) > self._cache_size:
            self._verified.popitem(last=False)
        return Principal(stored.key_id)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenSigner:
    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    def mint(
        self, principal: Principal, ttl_s: float, voices: Iterable[str] | None, now: float | None = None
    ) -> str:
        now = time.time() if now is None else now
        scope = sorted(set(voices)) if voices is not None else None
        if principal.voices is not None:  # a token never widens the scope it was minted under
            scope = sorted(set(scope or principal.voices) & principal.voices)
        payload = json.dumps(
            {"k": principal.key_id, "v": scope, "exp": int(now + ttl_s), "n": secrets.token_hex(4)},
            separators=(",", ":"),
        ).encode()
        return f"{_b64(payload)}.{_b64(self._sign(payload))}"

    def verify(self, token: str, now: float | None = None) -> Principal:
        now = time.time() if now is None else now
        try:
            body, signature = token.split(".")
            payload = _unb64(body)
            good = hmac.compare_digest(_unb64(signature), self._sign(payload))
        except (ValueError, binascii.Error):
            raise AuthError("malformed token") from None
        if not good:
            raise AuthError("invalid token signature")
        try:
            claims = json.loads(payload)
            key_id, voices, expires = claims["k"], claims["v"], claims["exp"]
        except (ValueError, KeyError, TypeError):
            raise AuthError("malformed token") from None
        if not isinstance(expires, int) or expires <= now:
            raise AuthError("token expired")
        return Principal(str(key_id), frozenset(voices) if voices is not None else None, via_token=True)

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()


def bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, credential = value.partition(" ")
    return credential.strip() or None if scheme.lower() == "bearer" else None


VENDOR_HEADERS = ("xi-api-key", "x-api-key")  # ElevenLabs, Cartesia
VENDOR_SCHEMES = ("bearer", "api-key", "token")  # Authorization schemes (Api-Key: Baseten)
WEBSOCKET_QUERY = ("token", "access_token", "api_key")


def presented_credential(headers: dict[str, str], query: str | None = None) -> str | None:
    """The key or token a request presents, however its vendor's client sends it; `query` (a
    WebSocket's query string) is read only when no header carries one."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() in VENDOR_SCHEMES and value.strip():
        return value.strip()
    for name in VENDOR_HEADERS:
        if headers.get(name, "").strip():
            return headers[name].strip()
    if query is None:
        return None
    params = parse_qs(query)
    return next((params[name][0] for name in WEBSOCKET_QUERY if params.get(name)), None)


def origin_allowed(
    origin: str | None, host: str | None, allowed: Iterable[str], scheme: str = "http"
) -> bool:
    """Non-browser clients send no Origin; a browser's must be listed, or the gateway's own."""
    if origin is None:
        return True
    allowed = tuple(allowed)
    if "*" in allowed or origin.rstrip("/") in {a.rstrip("/") for a in allowed}:
        return True
    parts = urlsplit(origin)
    return host is not None and parts.netloc == host and parts.scheme in ("http", "https")


class Authenticator:
    """Everything the routes need to decide who is calling."""

    def __init__(self, keys: KeyStore, signer: TokenSigner, allowed_origins: Iterable[str] = ()) -> None:
        self.keys = keys
        self.signer = signer
        self.allowed_origins = tuple(allowed_origins)

    @property
    def enabled(self) -> bool:
        return self.keys.enabled

    def authenticate(self, credential: str | None, token_allowed: bool = True) -> Principal:
        """A Bearer credential (a key, or a token where allowed) -> its principal."""
        if not self.enabled:
            return ANONYMOUS
        if not credential:
            raise AuthError("missing credentials: send Authorization: Bearer <key>")
        if credential.startswith(KEY_PREFIX):
            return self.keys.verify(credential)
        if token_allowed:
            return self.signer.verify(credential)
        raise AuthError("an API key is required here")


def from_environment(keys_file: str | None, allowed_origins: Iterable[str] = ()) -> Authenticator:
    """Keys from `keys_file` and CADENCE_API_KEYS, the token secret from CADENCE_TOKEN_SECRET."""
    keys = KeyStore.load(keys_file, os.environ.get("CADENCE_API_KEYS"))
    secret = os.environ.get("CADENCE_TOKEN_SECRET")
    return Authenticator(keys, TokenSigner(secret.encode() if secret else None), allowed_origins)


# -- on the wire -------------------------------------------------------------------------------

PUBLIC_PATHS = frozenset({"/", "/healthz", "/readyz", "/health", "/favicon.ico"})
PUBLIC_PREFIXES = ("/web/",)
# WebSockets whose dialect may send its credentials in its first message (ElevenLabs): without a
# credential they are let through marked `auth_deferred`, and the dialect authenticates
DEFERRED_PREFIXES = ("/v1/text-to-speech/",)
# Twilio's media stream: Twilio sends no header on the upgrade and drops the `<Stream>` url's query
# string, so its credential comes in `start.customParameters` (gateway.twilio.endpoints)
DEFERRED_PATHS = frozenset({"/v1/twilio"})
CLOSE_POLICY = 1008


def _deferred(path: str) -> bool:
    return path in DEFERRED_PATHS or path.startswith(DEFERRED_PREFIXES)


def auth_deferred(scope: Scope) -> bool:
    """The middleware let this WebSocket in without credentials, and none has been accepted since."""
    state = scope.get("state") or {}
    return bool(state.get("auth_deferred")) and "principal" not in state


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": "unauthorized"}},
        401,
        headers={"WWW-Authenticate": "Bearer"},
    )


class AuthMiddleware:
    """Every HTTP request and WebSocket outside the public paths must authenticate; the principal
    is left in `scope["state"]["principal"]`. A refused WebSocket is accepted and closed with 1008
    (a browser sees the reason; a 403 before the handshake says nothing)."""

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        path = scope.get("path", "")
        if kind not in ("http", "websocket") or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        websocket = kind == "websocket"
        credential = presented_credential(
            headers, scope.get("query_string", b"").decode("latin-1") if websocket else None
        )
        try:
            if websocket:
                if not origin_allowed(headers.get("origin"), headers.get("host"), self.auth.allowed_origins):
                    raise AuthError(f"origin {headers.get('origin', '')[:100]!r} is not allowed")
                if credential is None and self.auth.enabled and _deferred(path):
                    scope.setdefault("state", {})["auth_deferred"] = True
                    await self.app(scope, receive, send)
                    return
            principal = await self._authenticate(credential)
        except AuthError as exc:
            if kind == "http":
                await _unauthorized(str(exc))(scope, receive, send)
                return
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": CLOSE_POLICY, "reason": str(exc)[:120]})
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    async def _authenticate(self, credential: str | None) -> Principal:
        return await authenticate(self.auth, credential)


def principal_of(connection: HTTPConnection) -> Principal:
    """Who a request or WebSocket authenticated as (AuthMiddleware, or a dialect that takes its
    credentials later); without keys configured, the anonymous principal."""
    principal = connection.scope.get("state", {}).get("principal", ANONYMOUS)
    return principal if isinstance(principal, Principal) else ANONYMOUS


async def authenticate(auth: Authenticator, credential: str | None) -> Principal:
    """`auth.authenticate`, with a key's hash computed off the event loop; raises AuthError."""
    if credential and credential.startswith(KEY_PREFIX) and auth.enabled:
        return await asyncio.to_thread(auth.authenticate, credential)
    return auth.authenticate(credential)


def make_token_endpoint(auth: Authenticator, default_ttl_s: float = 300.0) -> Any:
    """POST /v1/tokens {"ttl_s": 300, "voices": ["Vivian"]} with an API key -> a browser token."""

    async def tokens(request: Request) -> Response:
        principal = principal_of(request)
        if principal.via_token:
            return _unauthorized("tokens are minted with an API key, not with a token")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _bad("the body must be a JSON object")
        ttl = body.get("ttl_s", default_ttl_s)
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 1 <= ttl <= MAX_TOKEN_TTL_S:
            return _bad(f"`ttl_s` must be a number of seconds from 1 to {MAX_TOKEN_TTL_S}")
        voices = body.get("voices")
        if voices is not None and (
            not isinstance(voices, list)
            or len(voices) > 100
            or not all(isinstance(v, str) and 0 < len(v) <= 128 for v in voices)
        ):
            return _bad("`voices` must be a list of at most 100 voice names")
        now = time.time()
        token = auth.signer.mint(principal, float(ttl), voices, now)
        return JSONResponse({"token": token, "expires_at": int(now + ttl), "voices": voices})

    return tokens


def _bad(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_message"}}, 400
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m gateway.auth new NAME`: print a new key and the line to configure."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "new":
        print("usage: python -m gateway.auth new NAME", file=sys.stderr)
        return 2
    try:
        key, stored = new_key(argv[1])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"key (give it to the client; it is not stored): {key}")
    print(f"line for the keys file or CADENCE_API_KEYS:     {stored.line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
