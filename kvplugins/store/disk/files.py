"""One object per file, crash-safe: a torn or corrupt file never reads back as an object.

Layout (little-endian): MAGIC ``b"KVPD"``, u16 version, u16 key length, u64 object size (bytes), u64 xxh3_64
of the object bytes, u64 xxh3_64 of the header fields before it plus the key, then the UTF-8 key, then the
object bytes. A write goes to ``tmp/`` first, is fsynced, renamed into ``objects/<aa>/<xxh3_128(key)>.kvd``, and
the directory is fsynced, so after ``write`` returns the file survives a crash; a crash before the rename leaves
only a temp file (removed at the next start). ``read_header`` checks magic, version, header checksum and file
length; ``read_into`` also checks the object checksum. Either raises CorruptFile.
"""
from __future__ import annotations

import itertools
import os
import struct
from pathlib import Path

import xxhash

from kvplugins.errors import StoreError

MAGIC = b"KVPD"
VERSION = 1
HEAD = struct.Struct("<4sHHQQ")       # magic, version, key length, size, object checksum
CHECK = struct.Struct("<Q")           # header checksum (over HEAD + key)
SUFFIX = ".kvd"


class CorruptFile(StoreError):
    """A disk-tier file is torn, truncated or fails its checksum (it is deleted and counted, never served)."""


def checksum(data) -> int:
    """xxh3_64 (seed 0) of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def file_name(key: str) -> str:
    """``<aa>/<xxh3_128 hex of key>.kvd`` relative to the objects directory."""
    h = xxhash.xxh3_128_hexdigest(key.encode())
    return f"{h[:2]}/{h}{SUFFIX}"


def header(key: str, size: int, digest: int) -> bytes:
    kb = key.encode()
    if len(kb) > 0xFFFF:
        raise StoreError(f"key of {len(kb)} bytes is too long for the disk tier (max 65535)")
    head = HEAD.pack(MAGIC, VERSION, len(kb), size, digest) + kb
    return head + CHECK.pack(checksum(head))


class Writer:
    """Writes object files under ``root`` (``objects/`` and ``tmp/`` inside it). Thread-safe."""

    def __init__(self, root: Path):
        self.objects, self.tmp = root / "objects", root / "tmp"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._seq = itertools.count()

    def write(self, key: str, data, digest: int) -> Path:
        """Durably store ``data`` (bytes-like, ``digest`` = its checksum) as ``key``'s file; returns its path.
        Raises OSError (disk full, I/O error); a failed write leaves no file behind."""
        path = self.objects / file_name(key)
        tmp = self.tmp / f"{path.stem}.{os.getpid()}.{next(self._seq)}.tmp"
        view = memoryview(data).cast("B")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, header(key, view.nbytes, digest))
            _write_all(fd, view)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        path.parent.mkdir(exist_ok=True)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return path


def read_header(path: Path) -> tuple[str, int, int]:
    """(key, size, object checksum) of a file. Raises CorruptFile (torn/garbled header, wrong length), OSError."""
    with open(path, "rb") as f:
        head = f.read(HEAD.size)
        if len(head) < HEAD.size:
            raise CorruptFile(f"{path}: truncated header")
        magic, version, klen, size, digest = HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise CorruptFile(f"{path}: not a kvplugins disk-tier file (magic {magic!r}, version {version})")
        kb = f.read(klen)
        (check,) = CHECK.unpack(f.read(CHECK.size).ljust(CHECK.size, b"\0"))
    if len(kb) != klen or check != checksum(head + kb):
        raise CorruptFile(f"{path}: header checksum mismatch")
    if os.path.getsize(path) != data_offset(klen) + size:
        raise CorruptFile(f"{path}: length {os.path.getsize(path)} != header + {size} object bytes (torn write)")
    return kb.decode(), size, digest


def data_offset(key_len: int) -> int:
    return HEAD.size + key_len + CHECK.size


def read_into(path: Path, key: str, dest: memoryview) -> int:
    """Read ``key``'s object from ``path`` into ``dest`` (exactly its size) and verify it; returns the checksum.
    Raises CorruptFile (bad header, other key, size mismatch, checksum mismatch), OSError."""
    got_key, size, digest = read_header(path)
    if got_key != key or size != dest.nbytes:
        raise CorruptFile(f"{path}: holds {got_key!r} ({size} bytes), expected {key!r} ({dest.nbytes} bytes)")
    with open(path, "rb", buffering=0) as f:
        f.seek(data_offset(len(key.encode())))
        n = 0
        while n < size:
            got = f.readinto(dest[n:])
            if not got:
                raise CorruptFile(f"{path}: ends after {n} of {size} object bytes")
            n += got
    if checksum(dest) != digest:
        raise CorruptFile(f"{path}: object checksum mismatch (the file is corrupt)")
    return digest


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
