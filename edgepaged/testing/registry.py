"""A loopback HTTP server laid out as Ollama's model registry, for testing pulls by Ollama name
(EDGEPAGED_OLLAMA_REGISTRY points the box here):

    GET /v2/NAMESPACE/MODEL/manifests/TAG     the manifest (404 when there is none)
    GET /v2/NAMESPACE/MODEL/blobs/DIGEST      307 to /cdn/DIGEST, as the real registry redirects
    GET /cdn/DIGEST                           the bytes (Range: bytes=N- honoured: 206)

    reg = FakeRegistry()
    reg.add("library/tiny", "1b", gguf_bytes, system="You are Ada.", parameters={"temperature": 0})
    with reg: ...                              # reg.url

Faults: `cut_after` (the first transfer of each blob stops after that many bytes, the
connection closed mid-body) and `lie` (digests whose bytes are served wrong). Every request is
recorded in `requests` as (method, path, Range header or None).
"""
from __future__ import annotations

import hashlib
import json
from http.server import BaseHTTPRequestHandler

from .loopback import LoopbackServer
from pathlib import Path

MEDIA = "application/vnd.ollama.image."


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeRegistry(LoopbackServer):
    def __init__(self, *, cut_after: int | None = None):
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.cut_after = cut_after
        self.lie: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []
        self._cut_done: set[str] = set()
        super().__init__()

    def blob(self, data: bytes, media: str) -> dict:
        d = digest_of(data)
        self.blobs[d] = data
        return {"mediaType": media, "digest": d, "size": len(data)}

    def add(self, repo: str, tag: str, gguf: bytes | Path, *, family: str = "llama", system: str | None = None,
            parameters: dict | None = None, template: str | None = None, projector: bytes | None = None) -> dict:
        """A model `repo` (NAMESPACE/MODEL) at `tag`; returns its manifest."""
        data = Path(gguf).read_bytes() if isinstance(gguf, Path) else gguf
        layers = [self.blob(data, MEDIA + "model")]
        if projector is not None:
            layers.append(self.blob(projector, MEDIA + "projector"))
        if template is not None:
            layers.append(self.blob(template.encode(), MEDIA + "template"))
        if system is not None:
            layers.append(self.blob(system.encode(), MEDIA + "system"))
        if parameters is not None:
            layers.append(self.blob(json.dumps(parameters).encode(), MEDIA + "params"))
        families = [family] + (["clip"] if projector is not None else [])
        config = json.dumps({"model_format": "gguf", "model_family": family, "model_families": families,
                             "model_type": "1B", "file_type": "Q8_0"}).encode()
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": self.blob(config, "application/vnd.docker.container.image.v1+json"), "layers": layers}
        self.manifests[(repo, tag)] = json.dumps(manifest).encode()
        return manifest

    def gets_of(self, digest: str) -> list[str | None]:
        """The Range headers of the byte transfers of `digest` (None: from the start)."""
        return [rng for m, p, rng in self.requests if m == "GET" and p == f"/cdn/{digest}"]

    def _handler(self):
        reg = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                reg.requests.append(("GET", path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if len(parts) == 5 and parts[0] == "v2" and parts[3] == "manifests":
                    m = reg.manifests.get(("/".join(parts[1:3]), parts[4]))
                    if m is None:
                        return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}',
                                          {"Content-Type": "application/json"})
                    return self._send(200, m, {"Content-Type": "application/vnd.docker.distribution.manifest.v2+json"})
                if len(parts) == 5 and parts[0] == "v2" and parts[3] == "blobs":
                    if parts[4] not in reg.blobs:
                        return self._send(404, b"blob unknown")
                    return self._send(307, b"", {"Location": f"/cdn/{parts[4]}"})
                if len(parts) == 2 and parts[0] == "cdn" and parts[1] in reg.blobs:
                    data = reg.blobs[parts[1]]
                    if parts[1] in reg.lie:
                        data = bytes(len(data))
                    start = 0
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        start = int(rng[6:].split("-")[0] or 0)
                    body = data[start:]
                    headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
                    if start:
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                    status = 206 if start else 200
                    if reg.cut_after is not None and parts[1] not in reg._cut_done and len(body) > reg.cut_after:
                        reg._cut_done.add(parts[1])     # this transfer stops short, the socket closes
                        self.send_response(status)
                        for k, v in {**headers, "Content-Length": str(len(body))}.items():
                            self.send_header(k, v)
                        self.end_headers()
                        self.wfile.write(body[:reg.cut_after])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    return self._send(status, body, headers)
                return self._send(404, b"not found")

        return Handler
