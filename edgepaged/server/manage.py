"""Models managed over Ollama's API: /api/pull, /api/delete, /api/copy, /api/create and
/api/blobs/:digest, on top of the model store (store.py, registry.py).

Who may: on a box with tokens, an admin (the one shared token, or a user named in
`users.admins`); on an open box, a caller on the box itself (loopback) or in a network
`serve --admin-from CIDR` names. Everyone else gets a 403 that names the flag.

The store's work (downloads, hashing, linking files) runs on worker threads; its progress
comes back to the event loop over a channel and goes out as Ollama's NDJSON status lines.
A model pulled, copied or created while a several-model box runs is served at once; one
deleted is unloaded first (its requests finish) and then forgotten.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import shutil
import threading
from functools import partial
from pathlib import Path

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from ..common import brief
from ..box import pulls, store
from ..common.lanes import MANAGE
from ..box.store import StoreError
from .doors.ollama import OllamaError

log = logging.getLogger("edgepaged.manage")
BLOB_CHUNK = 1 << 20
DISK_MARGIN = 256 << 20       # an upload leaves this much of the disk free


def parse_networks(cidrs) -> tuple:
    """--admin-from values as networks; ValueError naming a bad one."""
    out = []
    for c in cidrs or ():
        try:
            out.append(ipaddress.ip_network(c.strip(), strict=False))
        except ValueError:
            raise ValueError(f"--admin-from {c!r} is not a network (e.g. 192.168.1.0/24 or 10.0.0.5)") from None
    return tuple(out)


def loopback(host: str) -> bool:
    """Whether `host` (an address, IPv4-mapped too, or "localhost") is this box's loopback."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return ip.is_loopback


class ModelAdmin:
    """The model-management endpoints of one HttpServer (its auth, its model set)."""

    def __init__(self, http, admin_from=(), root: Path | None = None):
        self.http = http
        self.networks = parse_networks(admin_from)
        self.root = root                      # None: store.store_dir() when asked

    # -- who may -------------------------------------------------------------------------------
    async def check(self, request: HttpRequest) -> None:
        front = self.http.front
        peer = self.http._peer(request)
        if front.auth_required:
            try:
                user = await self.http._authorize(request)
            except Exception as e:          # ApiError: 401 in Ollama's shape
                raise OllamaError.of(e) from None
            if not front.caller(user, None, peer).sees_all:
                raise OllamaError(403, "managing models takes an admin's token (a user named in the config's "
                                  "users.admins)", "forbidden")
            return
        try:
            ip = ipaddress.ip_address(peer)
        except ValueError:
            ip = None
        if loopback(peer) or (ip is not None and any(ip in n for n in self.networks)):
            return
        raise OllamaError(403, f"managing models is allowed from this box only; {peer} may when the server runs "
                          "with --admin-from CIDR (e.g. --admin-from 192.168.1.0/24) or with tokens", "forbidden")

    async def _body(self, request: HttpRequest) -> dict:
        try:
            return await self.http._json_body(request)
        except Exception as e:               # ApiError: Ollama's shape on /api/
            raise OllamaError.of(e) from None

    @staticmethod
    def _name(body: dict, *keys: str) -> str:
        for k in keys:
            v = body.get(k)
            if v is not None:
                if not isinstance(v, str) or not v.strip():
                    raise OllamaError(400, f"{k} must be a model's name (a string)", "bad_request")
                return v.strip()
        raise OllamaError(400, f"{keys[0]} is required", "bad_request")

    @staticmethod
    def _stream(body: dict) -> bool:
        v = body.get("stream", True)
        if not isinstance(v, bool):
            raise OllamaError(400, "stream must be true or false", "bad_request")
        return v

    # -- the model set ---------------------------------------------------------------------------
    async def _serve_new(self, entry) -> None:
        models = self.http.modelset
        if models is None:
            log.info("%s is in the store; this box serves %s only (serve --model all serves every stored model)",
                     entry.name, self.http.front.model)
            return
        from ..box.models import ModelSpec
        if entry.name in models.slots:
            await models.remove(entry.name)
        models.add(ModelSpec.of(entry))
        log.info("%s added to the models this box serves", entry.name)

    # -- endpoints -------------------------------------------------------------------------------
    async def pull(self, request: HttpRequest) -> Response:
        await self.check(request)
        body = await self._body(request)
        spec = self._name(body, "model", "name")
        root = self.root
        from ..box import registry
        if not registry.is_ollama_name(spec) and (spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf")):
            raise OllamaError(400, f"{spec!r}: over the API, pull takes an Ollama name (llama3.2:3b) or a Hugging "
                              "Face repository (OWNER/NAME[:FILE]), never a path", "bad_request")

        def work(progress):
            progress("pulling manifest")
            return pulls.pull(spec, root=root, progress=progress, local_files=False)
        return ProgressStream(work, self._stream(body), after=self._serve_new)

    async def delete(self, request: HttpRequest) -> Response:
        await self.check(request)
        name = self._name(await self._body(request), "model", "name")
        try:
            entry = await trio.to_thread.run_sync(store.remove, name, self.root, limiter=MANAGE)
        except StoreError as e:
            raise OllamaError(e.status, f"model {name!r} not found" if e.status == 404 else str(e),
                              "not_found" if e.status == 404 else "bad_request") from None
        if self.http.modelset is not None:
            await self.http.modelset.remove(entry.name)
        log.info("deleted %s", entry.name)
        return Response(status_code=200)

    async def copy(self, request: HttpRequest) -> Response:
        await self.check(request)
        body = await self._body(request)
        source, destination = self._name(body, "source"), self._name(body, "destination")
        try:
            entry = await trio.to_thread.run_sync(partial(store.copy, source, destination, self.root, paths=False),
                                                  limiter=MANAGE)
        except StoreError as e:
            raise OllamaError(e.status, f"model {source!r} not found" if e.status == 404 else str(e),
                              "not_found" if e.status == 404 else "bad_request") from None
        await self._serve_new(entry)
        return Response(status_code=200)

    async def create(self, request: HttpRequest) -> Response:
        await self.check(request)
        body = await self._body(request)
        name = self._name(body, "model", "name")
        if body.get("modelfile") is not None and not (body.get("from") or body.get("files")):
            raise OllamaError(400, "a Modelfile is not taken: send from (a model's name) or files (an uploaded GGUF "
                              "blob), with system, template and parameters as fields", "bad_request")
        fields = {}
        for key, kind in (("from", str), ("files", dict), ("adapters", dict), ("system", str), ("template", str),
                          ("parameters", dict), ("messages", list), ("quantize", str), ("license", (str, list))):
            v = body.get(key)
            if v is not None and not isinstance(v, kind):
                raise OllamaError(400, f"{key} has the wrong type", "bad_request")
            fields[key] = v
        root = self.root
        from ..box import registry

        def work(progress):
            base = fields["from"]
            if base and not fields["files"]:
                try:
                    store.find(base, root, paths=False)
                except StoreError:
                    if not registry.is_ollama_name(base):
                        raise
                    progress("pulling manifest")
                    pulls.pull(base, root=root, progress=progress)
            if fields["files"]:
                progress("parsing GGUF")
            entry = store.create(name, from_=base, files=fields["files"], root=root, quantize=fields["quantize"],
                                 adapters=fields["adapters"], system=fields["system"], template=fields["template"],
                                 parameters=fields["parameters"], messages=fields["messages"],
                                 license=fields["license"], paths=False)
            progress(f"using existing layer sha256:{entry.sha256}")
            progress("writing manifest")
            return entry
        return ProgressStream(work, self._stream(body), after=self._serve_new)

    async def blob_head(self, request: HttpRequest) -> Response:
        await self.check(request)
        try:
            path = store.blob_path(request.path_params["digest"], self.root)
        except StoreError as e:
            raise OllamaError(400, str(e), "bad_request") from None
        return Response(status_code=200 if path.is_file() else 404)

    async def blob_post(self, request: HttpRequest) -> Response:
        await self.check(request)
        digest = request.path_params["digest"]
        try:
            path = store.blob_path(digest, self.root)
        except StoreError as e:
            raise OllamaError(400, str(e), "bad_request") from None
        if path.is_file():
            return Response(status_code=200)
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > free - DISK_MARGIN:
            raise OllamaError(413, f"the blob is {int(length)} bytes and the store's disk has {free} free", "too_large")
        part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{id(request)}.part")
        h = hashlib.sha256()
        size = 0

        def write(f, data: bytes) -> None:
            f.write(data)
            h.update(data)
        try:
            with open(part, "wb") as f:
                buf = bytearray()
                async for chunk in request.stream():
                    buf += chunk
                    size += len(chunk)
                    if size > free - DISK_MARGIN:
                        raise OllamaError(413, "the blob does not fit on the store's disk", "too_large")
                    if len(buf) >= BLOB_CHUNK:
                        await trio.to_thread.run_sync(write, f, bytes(buf), limiter=MANAGE)
                        buf.clear()
                if buf:
                    await trio.to_thread.run_sync(write, f, bytes(buf), limiter=MANAGE)
            got = "sha256:" + h.hexdigest()
            if got != digest.replace("sha256-", "sha256:"):
                raise OllamaError(400, f'digest mismatch, expected "{digest}", got "{got}"', "bad_request")
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        log.info("blob %s stored (%d bytes)", digest[:19], size)
        return Response(status_code=201)


class ProgressStream:
    """An ASGI response that runs `work(progress)` on a worker thread: with `stream`, each
    progress call is one NDJSON line (Ollama's `status`, `digest`, `total`, `completed`), then
    `{"status": "success"}` or `{"error": ...}`; without, the last status or the error with its
    status code. `after(result)` runs on the event loop when the work succeeded. A client that
    leaves stops the work at its next progress call (a partial download stays, to resume)."""

    def __init__(self, work, stream: bool, after=None):
        self.work, self.stream, self.after = work, stream, after

    async def __call__(self, scope, receive, send) -> None:
        send_ch, recv_ch = trio.open_memory_channel(256)
        gone = threading.Event()

        def progress(status: str, digest=None, total=None, completed=None) -> None:
            if gone.is_set():
                raise StoreError("the client left")
            line = {"status": status}
            line.update({k: v for k, v in (("digest", digest), ("total", total), ("completed", completed)) if v})
            trio.from_thread.run(send_ch.send, line)

        async def run() -> None:
            async with send_ch:
                try:
                    result = await trio.to_thread.run_sync(self.work, progress, limiter=MANAGE)
                    if self.after is not None:
                        await self.after(result)
                    await send_ch.send({"status": "success"})
                except StoreError as e:
                    await send_ch.send({"error": str(e), "_code": e.status})
                except Exception as e:       # noqa: BLE001 - one line in the log, a short error out
                    log.error("model management failed: %s", brief.of(e))
                    log.debug("model management failed", exc_info=e)
                    await send_ch.send({"error": "the server failed on this request (see its log)", "_code": 500})

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            if self.stream:
                watcher = trio.CancelScope()

                async def watching():
                    with watcher:
                        await watch()
                nursery.start_soon(watching)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/x-ndjson")]})
                async for line in recv_ch:
                    line.pop("_code", None)
                    if not gone.is_set():
                        try:
                            await send({"type": "http.response.body", "body": json.dumps(line).encode() + b"\n",
                                        "more_body": True})
                        except OSError:
                            gone.set()
                if not gone.is_set():
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                watcher.cancel()
            else:
                last = {}
                async for line in recv_ch:
                    last = line
                code = last.pop("_code", 200)
                await send({"type": "http.response.start", "status": code,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": json.dumps(last).encode(), "more_body": False})
