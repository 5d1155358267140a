"""Pulling by Ollama names: the registry protocol Ollama's own `pull` speaks (a Docker-style
manifest, then blobs by digest), into edgepaged's store.

    ref = parse_name("llama3.2:3b")           # host, namespace "library", model, tag
    entry = pull_ollama("llama3.2:3b", progress=print_status)

The manifest is fetched first; a layer the runtime does not run (a LoRA adapter) and a config
naming another format or family are refused before a byte of weights moves; a vision
projector layer (llava's: llama.cpp's mmproj) is fetched and checked first and kept beside the
model as `NAME.mmproj.gguf`. Blobs download to the store's `.downloads/` folder under their digest, resume with an
HTTP Range request after a cut, and count only when their sha256 matches the digest; the GGUF
is then checked like any other pull (store.inspect). The registry is the one the box is
configured with (EDGEPAGED_OLLAMA_REGISTRY, default Ollama's public one): a name never makes
the box fetch another address (names carrying a host are refused unless it is that host).
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .store import Entry, StoreError, add_file, check_name, claim, slug, store_dir

REGISTRY_ENV = "EDGEPAGED_OLLAMA_REGISTRY"
DEFAULT_REGISTRY = "https://registry.ollama.ai"
MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA = "application/vnd.ollama.image."
MODEL_MEDIA = MEDIA + "model"
# layers whose text edgepaged keeps beside the weights
TEXT_LAYERS = {MEDIA + "system": "system", MEDIA + "template": "template", MEDIA + "license": "license"}
PARAMS_MEDIA = MEDIA + "params"
MESSAGES_MEDIA = MEDIA + "messages"
PROJECTOR_MEDIA = MEDIA + "projector"     # a vision model's tower + projector (llama.cpp's mmproj GGUF: llava)
REFUSED_LAYERS = {MEDIA + "adapter": "a LoRA adapter, which edgepaged does not apply"}
MAX_PROJECTOR_BYTES = 8 << 30
MAX_MANIFEST_BYTES = 1 << 20
MAX_TEXT_LAYER_BYTES = 1 << 20
TIMEOUT_S = 30.0
CHUNK = 1 << 20
PART_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

_locks: dict[str, threading.Lock] = {}       # one pull of a name at a time
_locks_guard = threading.Lock()

Progress = Callable[..., None]   # progress(status, digest=None, total=None, completed=None)


@dataclass(frozen=True)
class Ref:
    scheme: str
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def name(self) -> str:
        """The name a household uses: `llama3.2:3b` in the library, `user/model:tag` else."""
        base = self.model if self.namespace == "library" else f"{self.namespace}/{self.model}"
        return f"{base}:{self.tag}"

    def url(self, kind: str, what: str) -> str:
        return f"{self.scheme}://{self.host}/v2/{self.namespace}/{self.model}/{kind}/{what}"


def registry_base() -> tuple[str, str]:
    """(scheme, host) of the registry this box pulls from."""
    base = os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY
    scheme, sep, host = base.rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https") or not host or "/" in host:
        raise StoreError(f"{REGISTRY_ENV}={base!r} is not a registry address (http[s]://HOST[:PORT])")
    return scheme, host


def is_ollama_name(spec: str) -> bool:
    """`model[:tag]` with no slash: a name in Ollama's library; HOST/NAMESPACE/MODEL[:TAG] (a
    repository on the hub is always OWNER/NAME); `ollama:NAME` says it outright for
    `user/model:tag`."""
    if spec.startswith("ollama:"):
        return True
    return bool(spec) and not spec.lower().endswith(".gguf") and spec.count("/") in (0, 2)


def parse_name(spec: str) -> Ref:
    """An Ollama model name as Ollama reads it: [HOST/][NAMESPACE/]MODEL[:TAG], the namespace
    `library` and the tag `latest` when left out. A HOST other than the configured registry's
    is refused: a pull never fetches an address a client supplies."""
    scheme, host = registry_base()
    name = spec.removeprefix("ollama:").strip()
    base, _, tag = name.rpartition(":") if ":" in name.rpartition("/")[2] else (name, "", "latest")
    parts = base.split("/")
    if len(parts) == 3:
        if parts[0].lower() != host.lower():
            raise StoreError(f"{spec!r} names the registry {parts[0]!r}; this box pulls Ollama names only from "
                             f"{host} (set {REGISTRY_ENV} on the server to change it)")
        parts = parts[1:]
    if len(parts) == 1:
        parts = ["library"] + parts
    if len(parts) != 2:
        raise StoreError(f"{spec!r} is not an Ollama model name ([NAMESPACE/]MODEL[:TAG])")
    namespace, model = (p.lower() for p in parts)
    tag = tag or "latest"
    for part, what in ((namespace, "namespace"), (model, "model"), (tag.lower(), "tag")):
        if not PART_RE.match(part) or len(part) > 80:
            raise StoreError(f"{spec!r}: {part!r} is not a valid {what} in an Ollama name")
    return Ref(scheme, host, namespace, model, tag)


def _open(url: str, headers: dict | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": "edgepaged", **(headers or {})})
    return urllib.request.urlopen(req, timeout=TIMEOUT_S)


def _http_error(e: Exception, what: str, ref: Ref) -> StoreError:
    if isinstance(e, urllib.error.HTTPError):
        if e.code in (401, 403, 404):
            return StoreError(f"{ref.name}: no such model in the registry {ref.host} (pull the name Ollama's "
                              f"library lists, e.g. llama3.2:3b)" if what == "manifest" else
                              f"{ref.name}: the registry refused its {what} ({e.code})", 404)
        return StoreError(f"{ref.name}: the registry answered {e.code} for its {what}; pull again to retry", 502)
    return StoreError(f"{ref.name}: cannot reach the registry {ref.host} for its {what} "
                      f"({type(e).__name__}: {getattr(e, 'reason', e)}); pull again to retry", 502)


def _read_small(ref: Ref, url: str, limit: int, what: str, headers: dict | None = None) -> bytes:
    try:
        with _open(url, headers) as r:
            data = r.read(limit + 1)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise _http_error(e, what, ref) from None
    if len(data) > limit:
        raise StoreError(f"{ref.name}: its {what} is over {limit} bytes; refused")
    return data


def fetch_manifest(ref: Ref) -> dict:
    data = _read_small(ref, ref.url("manifests", ref.tag), MAX_MANIFEST_BYTES, "manifest",
                       {"Accept": MANIFEST_ACCEPT})
    try:
        manifest = json.loads(data)
        layers = manifest["layers"]
        for layer in layers + [manifest.get("config") or {"digest": "sha256:" + "0" * 64, "size": 0}]:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(layer.get("digest"))) or \
                    not isinstance(layer.get("size"), int) or layer["size"] < 0:
                raise ValueError("a layer without a sha256 digest and a size")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreError(f"{ref.name}: the registry's manifest is not one edgepaged reads ({e})") from None
    return manifest


def check_manifest(ref: Ref, manifest: dict) -> dict:
    """The model layer, after refusing what the runtime cannot serve (before any download)."""
    for layer in manifest["layers"]:
        why = REFUSED_LAYERS.get(layer.get("mediaType"))
        if why:
            raise StoreError(f"{ref.name} comes with {why}; refused (pull a text-only model)")
    models = [x for x in manifest["layers"] if x.get("mediaType") == MODEL_MEDIA]
    if len(models) != 1:
        raise StoreError(f"{ref.name}: the manifest has {len(models)} model layers; edgepaged takes exactly one "
                         "GGUF file")
    projectors = [x for x in manifest["layers"] if x.get("mediaType") == PROJECTOR_MEDIA]
    if len(projectors) > 1 or any(not 0 < int(x.get("size", 0)) <= MAX_PROJECTOR_BYTES for x in projectors):
        raise StoreError(f"{ref.name}: the manifest's vision projector layers are not one projector file")
    return models[0]


def _check_config(ref: Ref, config: dict) -> None:
    from ..model import families as decoders
    from ..model.loader import EMBEDDING_ARCHS
    fmt = config.get("model_format")
    if fmt and fmt != "gguf":
        raise StoreError(f"{ref.name} is in the {fmt} format; edgepaged serves GGUF files")
    family = config.get("model_family")
    families = config.get("model_families") or ([family] if family else [])
    known = set(decoders.names()) | set(EMBEDDING_ARCHS)
    if family and family not in known:
        raise StoreError(f"{ref.name} is a {family} model; edgepaged runs {', '.join(sorted(known))}")
    others = [f for f in families if f not in known and f != "clip"]     # (clip: its vision projector)
    if others:
        raise StoreError(f"{ref.name} includes {', '.join(others)}; edgepaged runs {', '.join(sorted(known))}")


def download_blob(ref: Ref, layer: dict, dest: Path, progress: Progress | None = None) -> Path:
    """The blob `layer` names into `dest` (a `.part` beside it while it comes), resumed from
    what an earlier cut attempt left, checked against its digest."""
    digest, total = layer["digest"], layer["size"]
    short = digest.partition(":")[2][:12]
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > total:
        part.unlink()
        have = 0
    h = hashlib.sha256()
    if have:
        with open(part, "rb") as f:                # the bytes already here count toward the digest
            while chunk := f.read(CHUNK):
                h.update(chunk)
    status = f"pulling {short}"
    if progress:
        progress(status, digest=digest, total=total, completed=have)
    if have < total:
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with _open(ref.url("blobs", digest), headers) as r:
                if have and r.status != 206:        # the server sent it all again: start over
                    have, h = 0, hashlib.sha256()
                mode = "ab" if have else "wb"
                with open(part, mode) as f:
                    last = have
                    while have < total:
                        chunk = r.read(min(CHUNK, total - have))
                        if not chunk:
                            break
                        f.write(chunk)
                        h.update(chunk)
                        have += len(chunk)
                        if progress and (have - last >= 8 * CHUNK or have == total):
                            progress(status, digest=digest, total=total, completed=have)
                            last = have
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise StoreError(f"{ref.name}: the download of {short} broke at {have} of {total} bytes "
                             f"({type(e).__name__}: {getattr(e, 'reason', e)}); pull again to resume", 502) from None
        if have < total:
            raise StoreError(f"{ref.name}: the download of {short} broke at {have} of {total} bytes; pull again "
                             "to resume", 502)
    if progress:
        progress("verifying sha256 digest", digest=digest, total=total, completed=total)
    if "sha256:" + h.hexdigest() != digest:
        part.unlink(missing_ok=True)
        raise StoreError(f"{ref.name}: the blob {short} does not match its digest (sha256 {h.hexdigest()[:12]}…); "
                         "it was removed, pull again")
    os.replace(part, dest)
    return dest


def pull_ollama(spec: str, name: str | None = None, root: Path | None = None,
                progress: Progress | None = None) -> Entry:
    """Pull an Ollama name from the registry into the store, under that name (or `name`); two
    pulls of one name at once: the second waits and finds the first's model."""
    root = root or store_dir()
    ref = parse_name(spec)
    name = check_name(name or ref.name)
    with _locks_guard:
        lock = _locks.setdefault(f"{root}\0{name}", threading.Lock())
    with lock:
        return _pull_locked(ref, name, root, progress)


def _pull_locked(ref: Ref, name: str, root: Path, progress: Progress | None) -> Entry:
    say = progress or (lambda *a, **k: None)
    say("pulling manifest")
    manifest = fetch_manifest(ref)
    model_layer = check_manifest(ref, manifest)
    cfg = manifest.get("config")
    if cfg and cfg.get("size", 0) <= MAX_TEXT_LAYER_BYTES:
        try:
            _check_config(ref, json.loads(_read_small(ref, ref.url("blobs", cfg["digest"]), MAX_TEXT_LAYER_BYTES,
                                                      "config")))
        except ValueError:
            pass                                   # an unreadable config says nothing: the GGUF check decides
    from .store import find, remove
    try:
        have = find(name, root) if (root / f"{slug(name)}.json").exists() else None
    except StoreError:
        have = None
    if have is not None and have.sha256 == model_layer["digest"].partition(":")[2]:
        if progress:                       # already here, the same bytes: nothing to fetch
            progress(f"pulling {have.sha256[:12]}", digest=model_layer["digest"], total=model_layer["size"],
                     completed=model_layer["size"])
        return have
    work = root / ".downloads"
    work.mkdir(parents=True, exist_ok=True)
    extras: dict = {}
    for layer in manifest["layers"]:
        media = layer.get("mediaType")
        key = TEXT_LAYERS.get(media) or ("parameters" if media == PARAMS_MEDIA else
                                         "messages" if media == MESSAGES_MEDIA else None)
        if key is None or layer["size"] > MAX_TEXT_LAYER_BYTES:
            continue
        data = _read_small(ref, ref.url("blobs", layer["digest"]), MAX_TEXT_LAYER_BYTES, key)
        if "sha256:" + hashlib.sha256(data).hexdigest() != layer["digest"]:
            raise StoreError(f"{ref.name}: its {key} does not match its digest; pull again")
        if key in ("parameters", "messages"):
            try:
                extras[key] = json.loads(data)
            except ValueError:
                continue
        else:
            extras[key] = data.decode("utf-8", "replace")
    projector = None
    layer = next((x for x in manifest["layers"] if x.get("mediaType") == PROJECTOR_MEDIA), None)
    if layer is not None:    # the vision projector first (smaller): one the runtime cannot run moves no weights
        projector = download_blob(ref, layer, work / layer["digest"].replace(":", "-"), progress)
        try:
            from ..model.vision import VisionEncoder, read_mmproj
            kind = read_mmproj(projector)[0] or "mlp"
            if kind not in VisionEncoder.FAMILIES:
                raise ValueError(f"its projector type {kind!r} is not one edgepaged runs "
                                 f"({', '.join(VisionEncoder.FAMILIES)})")
        except (ValueError, KeyError, OSError) as e:
            projector.unlink(missing_ok=True)
            raise StoreError(f"{ref.name} comes with a vision projector edgepaged cannot use ({e}); refused") from None
    blob = download_blob(ref, model_layer, work / model_layer["digest"].replace(":", "-"), progress)
    say("writing manifest")
    if have is not None:                   # a newer version under the same name replaces the old one
        remove(name, root)
    claim(root, name)
    part = root / f".{slug(name)}.gguf.part"
    os.replace(blob, part)
    try:
        entry = add_file(root, name, part, f"ollama:{ref.host}/{ref.namespace}/{ref.model}:{ref.tag}",
                     model_layer["digest"].partition(":")[2], extras=extras)
    finally:
        part.unlink(missing_ok=True)
    if projector is not None:     # beside the model, where `serve` finds it (server/app.projector_for)
        os.replace(projector, Path(entry.path).with_suffix(".mmproj.gguf"))
    return entry
