"""A checkpoint directory as one P2P object (``kvplugins p2p publish`` / ``fetch``): every non-empty regular file
under it (safetensors shards, config.json, the tokenizer, ...) is a buffer, labelled with its path relative to
the directory. Publishing maps the files read-only (no copy; the page cache serves peers); fetching pulls
straight into the target files mapped writable under a hidden partial directory, then renames each into place,
so a reader never sees a half-written file and a failed fetch leaves none.

A fetched label is a path a peer wrote: it is used only when it is relative, normalised (no ``.``, ``..`` or
empty parts, no NUL) and stays inside the target directory; otherwise the fetch fails before a byte is written.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path, PurePosixPath

import numpy as np

from kvplugins.errors import ConfigError, KeyNotFound, ProtocolError
from kvplugins.p2p.catalog import Payload
from kvplugins.p2p.pull import Progress, PullStats
from kvplugins.p2p.store import P2PStore

log = logging.getLogger(__name__)

PARTIAL = ".kvplugins-p2p-partial"


def files_of(directory: str | os.PathLike[str]) -> list[Path]:
    """The non-empty regular files under ``directory``, sorted (empty ones are skipped with a log line).
    Raises ConfigError when it is not a directory or holds none."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory; pass the checkpoint directory")
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and PARTIAL not in p.parts):
        if path.stat().st_size == 0:
            log.warning("p2p publish: skipping the empty file %s", path)
            continue
        out.append(path)
    if not out:
        raise ConfigError(f"{str(root)!r} holds no non-empty files to publish")
    return out


def publish(
    store: P2PStore, name: str, directory: str | os.PathLike[str], chunk_bytes: int = 0, force: bool = False
) -> Payload:
    """Register the files of ``directory`` as object ``name`` (mapped read-only; they must stay unchanged while
    published). Raises as files_of and P2PStore.register."""
    root = Path(directory)
    files = files_of(root)
    maps = [np.memmap(f, dtype=np.uint8, mode="r") for f in files]
    labels = [f.relative_to(root).as_posix() for f in files]
    return store.register(name, maps, chunk_bytes, force, labels)


def safe_label(label: str, root: Path) -> Path:
    """Where file ``label`` (a peer's word) goes under ``root``. Raises ProtocolError for a label that is not a
    plain relative path inside ``root``."""
    parts = PurePosixPath(label).parts
    if (
        not label
        or "\0" in label
        or "\\" in label
        or label.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or PurePosixPath(*parts).as_posix() != label
        or PARTIAL in parts
    ):
        raise ProtocolError(f"p2p object file label {label!r:.200} is not a plain relative path; refusing to write it")
    path = root.joinpath(*parts)
    if not path.resolve().is_relative_to(root.resolve()):
        raise ProtocolError(f"p2p object file label {label!r:.200} leads outside {str(root)!r}; refusing it")
    return path


def fetch(store: P2PStore, name: str, directory: str | os.PathLike[str], progress: Progress | None = None) -> PullStats:
    """Pull object ``name`` into ``directory`` (created; files of the same names are replaced) and keep serving
    it from there until delete_replica / close. Raises KeyNotFound, ProtocolError (an unlabelled object or an
    unsafe label), and as P2PStore.get_replica; a failed fetch leaves no new file."""
    root = Path(directory)
    p = store.catalog.get(name)
    if p is None:
        raise KeyNotFound(f"p2p object {name!r} is not in the catalog at {store.cfg.etcd} (see kvplugins p2p list)")
    if not p.labels:
        raise ProtocolError(f"p2p object {name!r} has no file names (registered from memory, not a directory)")
    targets = [safe_label(label, root) for label in p.labels]
    part = root / PARTIAL / name.replace("/", "%2F")
    part.mkdir(parents=True, exist_ok=True)
    tmp = [part / f"{i}" for i in range(len(targets))]
    try:
        maps = []
        for path, size in zip(tmp, p.sizes):
            with open(path, "wb") as f:
                f.truncate(size)
            maps.append(np.memmap(path, dtype=np.uint8, mode="r+"))
        stats = store.get_replica(name, maps, progress)
        for m, path, target in zip(maps, tmp, targets):
            m.flush()
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        return stats
    finally:
        shutil.rmtree(part, ignore_errors=True)
        if not any((root / PARTIAL).iterdir()):
            (root / PARTIAL).rmdir()
