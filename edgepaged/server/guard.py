"""What a web page may do with the box (an ASGI middleware in front of the HTTP app).

A home box answers whatever its household's browsers send it, so every page a family
member visits could try to use it:

- **DNS rebinding.** A foreign site can point its own name at the box's address and then read
  answers as a same-origin page. Requests must name the box in `Host`: an IP address, its
  host name, `localhost`, a `.local` name (mDNS), or a name given with `--allowed-host`
  (exact, or `*.example.org` for a domain and its subdomains). Anything else: 421.
- **Simple cross-site requests.** A page may POST `text/plain` or a form to any address
  without asking first, and its browser then sends `Origin`. A POST that carries an `Origin`
  (other than one allowed with `--cors-origin`) must send its JSON as `application/json`
  (which a foreign page can only send after a CORS preflight): anything else, 415. Without
  `Origin` it is no browser's cross-site request (curl, scripts, Ollama's documented
  `curl -d '{...}'`, which sends `application/x-www-form-urlencoded`): the body is read as
  JSON whatever its declared type.
- **Cross-origin reads** are allowed to the origins given with `--cors-origin` (`*` for any)
  and to nobody by default; their preflight is answered here.
"""
from __future__ import annotations

import ipaddress
import json
import socket

JSON_TYPES = ("application/json",)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"


def host_name(host_header: str) -> str:
    """`Host` without its port: 'box.local:7879' -> 'box.local', '[::1]:7879' -> '::1'."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h[1:]
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


class HostPolicy:
    """The names a request may give in `Host`."""

    def __init__(self, allowed: list[str] | tuple[str, ...] = ()):
        own = socket.gethostname().lower().rstrip(".")
        self.exact = {"localhost", own, own.split(".")[0], *(a.lower().rstrip(".") for a in allowed
                                                             if not a.startswith("*."))}
        self.suffixes = (".localhost", ".local", *(a[1:].lower().rstrip(".") for a in allowed if a.startswith("*.")))

    def allows(self, host: str) -> bool:
        if not host:
            return True          # HTTP/1.0 without Host: no name to rebind
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
            return True          # an address names the box itself, never a foreign site
        except ValueError:
            pass
        return host in self.exact or host.endswith(self.suffixes) or f".{host}" in self.suffixes


def _json_error(status: int, message: str, code: str, path: str = "") -> tuple[int, list, bytes]:
    """The refusal in the door's shape: Ollama's {"error": "..."} under /api/, else OpenAI's."""
    kind = {415: "invalid_request_error", 421: "invalid_request_error", 403: "permission_error"}[status]
    if path.startswith("/api/"):
        body = json.dumps({"error": message}).encode()
    else:
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class Guard:
    """ASGI middleware: Host check, JSON content type for POST bodies, CORS for the origins
    allowed (preflight answered, headers added to their answers)."""

    def __init__(self, app, allowed_hosts=(), cors_origins=()):
        self.app = app
        self.hosts = HostPolicy(allowed_hosts)
        self.origins = set(cors_origins)

    def _origin_allowed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin in self.origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = host_name(headers.get("host", ""))
        if not self.hosts.allows(host):
            return await self._reply(send, *_json_error(
                421, f"Host {host!r} is not one of this box's names (use its address, its .local name or "
                     f"localhost, or start the server with --allowed-host {host})", "misdirected_request",
                scope.get("path", "")))
        origin = headers.get("origin")
        cors = self._origin_allowed(origin)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            if not cors:
                return await self._reply(send, *_json_error(
                    403, f"cross-origin requests from {origin!r} are not allowed (start the server with "
                         f"--cors-origin {origin} to allow them)", "cors_forbidden", scope.get("path", "")))
            return await self._reply(send, 204, self._cors_headers(origin) + [
                (b"access-control-allow-methods", CORS_METHODS.encode()),
                (b"access-control-allow-headers", CORS_HEADERS.encode()),
                (b"access-control-max-age", b"600")], b"")
        if scope["method"] == "POST" and origin is not None and not cors:   # a browser's, from a page
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media not in JSON_TYPES:
                return await self._reply(send, *_json_error(
                    415, f"the body must be sent as Content-Type: application/json, not {media or 'none'!r}",
                    "unsupported_media_type", scope.get("path", "")))
        if not cors:
            return await self.app(scope, receive, send)
        extra = self._cors_headers(origin)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)
        await self.app(scope, receive, send_with_cors)

    def _cors_headers(self, origin: str) -> list:
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    @staticmethod
    async def _reply(send, status: int, headers: list, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
