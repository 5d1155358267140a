"""A loopback HTTP server laid out as the Hugging Face hub's file URLs, for testing `pull`
with huggingface_hub's own download code (HF_ENDPOINT points it here):

    GET  /api/models/OWNER/NAME/tree/REV[/PATH]   the file list (sizes, LFS sha256)
    HEAD /OWNER/NAME/resolve/REV/FILE            metadata: commit, ETag (the sha256), size
    GET  /OWNER/NAME/resolve/REV/FILE            the bytes (Range: bytes=N- honoured)

Faults to test with: `cut_after` (the first transfer of a file stops after that many bytes,
the connection closed mid-body) and `lie_sha` (the listing and ETag claim another sha256).
Every request is recorded in `requests` as (method, path, Range header or None).
"""
from __future__ import annotations

import hashlib
import json
from http.server import BaseHTTPRequestHandler

from .loopback import LoopbackServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(LoopbackServer):
    def __init__(self, repos: dict[str, dict[str, bytes | Path]], *, cut_after: int | None = None,
                 lie_sha: set[str] = frozenset()):
        self.repos = {repo: {name: (Path(v).read_bytes() if isinstance(v, Path) else v) for name, v in files.items()}
                      for repo, files in repos.items()}
        self.cut_after, self.lie_sha = cut_after, set(lie_sha)
        self.requests: list[tuple[str, str, str | None]] = []
        self._cut_done: set[str] = set()
        super().__init__()

    def sha(self, repo: str, name: str) -> str:
        if name in self.lie_sha:
            return hashlib.sha256(b"not these bytes").hexdigest()
        return hashlib.sha256(self.repos[repo][name]).hexdigest()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head=False) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)

            def _route(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self._send(404, b'{"error":"Repository not found"}',
                                          {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"})
                    listing = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                                "path": name, "lfs": {"oid": hub.sha(repo, name), "size": len(data),
                                                      "pointerSize": 134}}
                               for name, data in sorted(hub.repos[repo].items())]
                    return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                    data = hub.repos.get(repo, {}).get(name)
                    if data is None:
                        return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
                    sha = hub.sha(repo, name)
                    meta = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                            "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes",
                            "Content-Type": "application/octet-stream"}
                    if head:
                        return self._send(200, b"", {**meta, "Content-Length": str(len(data))}, head=True)
                    start = 0
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        start = int(rng[6:].split("-")[0] or 0)
                    body = data[start:]
                    status = 206 if start else 200
                    headers = {**meta, "Content-Length": str(len(body))}
                    if start:
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                    if hub.cut_after is not None and name not in hub._cut_done:
                        hub._cut_done.add(name)         # this transfer stops short, the socket closes
                        self.send_response(status)
                        for k, v in headers.items():
                            self.send_header(k, v)
                        self.end_headers()
                        self.wfile.write(body[:hub.cut_after])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    return self._send(status, body, headers)
                return self._send(404, b"not found")

            def do_GET(self):
                self._route(head=False)

            def do_HEAD(self):
                self._route(head=True)

        return Handler
