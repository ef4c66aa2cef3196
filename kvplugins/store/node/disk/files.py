"""One object per file, crash-safe: a torn or corrupt file never reads back as an object.

Layout (little-endian): MAGIC ``b"KVPD"``, u16 version, u16 key length, u64 object size (bytes), u64 xxh3_64
of the object bytes, u64 xxh3_64 of the header fields before it plus the key, then the UTF-8 key, then the
object bytes. A write goes to ``tmp/`` first, is fsynced, renamed into ``objects/<aa>/<xxh3_128(key)>.kvd``, and
the directory is fsynced, so after ``write`` returns the file survives a crash; a crash before the rename leaves
only a temp file (removed at the next start). ``read_header`` checks every field before using it (magic,
version, key length, size against the file's length, header checksum, the key's UTF-8 and file name); a hostile
header can neither make it read or allocate beyond the file nor return another file's key; ``read_into`` also
checks the object checksum. Either raises CorruptFile (callers delete and count such a file, never serve it).
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
HEAD = struct.Struct("<4sHHQQ")  # magic, version, key length, size, object checksum
CHECK = struct.Struct("<Q")  # header checksum (over HEAD + key)
SUFFIX = ".kvd"
MAX_KEY = 0xFFFF  # key length in UTF-8 bytes (the u16 field)
MAX_OBJECT = 1 << 48  # object size in bytes (as the master's largest; store/wire/schema.py MAX_SIZE)


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
    """Header bytes of ``key``'s file for an object of ``size`` bytes with checksum ``digest``. Raises StoreError
    for an empty key, a key over MAX_KEY UTF-8 bytes or a size over MAX_OBJECT (``read_header`` would refuse it)."""
    kb = key.encode()
    if not 0 < len(kb) <= MAX_KEY:
        raise StoreError(f"key of {len(kb)} bytes does not fit the disk tier (1..{MAX_KEY})")
    if not 0 <= size <= MAX_OBJECT:
        raise StoreError(f"object of {size} bytes does not fit the disk tier (at most {MAX_OBJECT})")
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
    """(key, size in bytes, object checksum) of a file. Raises CorruptFile (torn, garbled or hostile header: see
    ``_parse``), OSError."""
    with open(path, "rb", buffering=0) as f:
        return _parse(path, f)[:3]


def read_into(path: Path, key: str, dest: memoryview) -> int:
    """Read ``key``'s object from ``path`` into ``dest`` (exactly its size) and verify it; returns the checksum.
    Header and bytes come from one open file (a rename in between cannot mix two files). Raises CorruptFile (bad
    header, other key, size mismatch, short file, checksum mismatch), OSError."""
    with open(path, "rb", buffering=0) as f:
        got_key, size, digest, offset = _parse(path, f)
        if got_key != key or size != dest.nbytes:
            raise CorruptFile(
                f"{path}: holds {got_key[:200]!r} ({size} bytes), expected {key[:200]!r} ({dest.nbytes} bytes)"
            )
        f.seek(offset)
        n = 0
        while n < size:
            got = f.readinto(dest[n:])
            if not got:
                raise CorruptFile(f"{path}: ends after {n} of {size} object bytes")
            n += got
    if checksum(dest) != digest:
        raise CorruptFile(f"{path}: object checksum mismatch (the file is corrupt)")
    return digest


def data_offset(key_len: int) -> int:
    """Byte offset of the object bytes in a file whose key is ``key_len`` UTF-8 bytes."""
    return HEAD.size + key_len + CHECK.size


def _parse(path: Path, f) -> tuple[str, int, int, int]:
    """(key, size, object checksum, data offset) of open file ``f`` at ``path``, each field range-checked before
    it is used: magic and version exact; key length in 1..MAX_KEY; size in 0..MAX_OBJECT and header + key +
    size == the file's length (nothing is read or allocated beyond the file); header checksum over the fields
    and the key; the key valid UTF-8 and the one the file is named after. Raises CorruptFile naming the field."""
    length = os.fstat(f.fileno()).st_size
    head = f.read(HEAD.size)
    if len(head) < HEAD.size:
        raise CorruptFile(f"{path}: truncated header ({length} bytes)")
    magic, version, klen, size, digest = HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise CorruptFile(
            f"{path}: not a kvplugins disk-tier file (magic {magic!r}, version {version}; "
            f"expected {MAGIC!r}, {VERSION})"
        )
    if not 0 < klen <= MAX_KEY:
        raise CorruptFile(f"{path}: key length {klen} outside 1..{MAX_KEY}")
    if size > MAX_OBJECT or data_offset(klen) + size != length:
        raise CorruptFile(
            f"{path}: length {length} != header + {klen}-byte key + {size} object bytes "
            f"(torn write or garbled size; objects are at most {MAX_OBJECT} bytes)"
        )
    kb, check = f.read(klen), f.read(CHECK.size)
    if len(kb) != klen or len(check) != CHECK.size or CHECK.unpack(check)[0] != checksum(head + kb):
        raise CorruptFile(f"{path}: header checksum mismatch")
    return _key_of(path, kb), size, digest, data_offset(klen)


def _key_of(path: Path, kb: bytes) -> str:
    """The key of header key bytes ``kb``, checked against the file's name (``file_name``: a file copied or
    renamed under another key's name would shadow it). Raises CorruptFile."""
    try:
        key = kb.decode()
    except UnicodeDecodeError as e:
        raise CorruptFile(f"{path}: key is not UTF-8 ({e})") from None
    want = Path(file_name(key))
    if (path.parent.name, path.name) != (want.parent.name, want.name):
        raise CorruptFile(f"{path}: holds key {key[:200]!r}, whose file is {want}")
    return key


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
