"""Shared memory that same-host peers can map: allocation (memfd or POSIX shm), mapping, host identity."""
from __future__ import annotations

import mmap
import os
import secrets
import socket

import numpy as np

from kvplugins.errors import TransferFailed


def host_id() -> str:
    """hostname + kernel boot id: equal exactly when two processes can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class Mapping:
    """An mmap of a shared file plus its address. ``close()`` unmaps (after the numpy view is dropped)."""

    def __init__(self, fd: int, length: int, path: str, unlink: str | None = None, keep_fd: bool = True):
        self.length, self.path, self._unlink, self._fd = length, path, unlink, fd
        self._mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if not keep_fd:  # the map keeps the memory; a memfd's fd must stay open for peers to find it
            os.close(fd)
            self._fd = -1
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)

    def close(self) -> None:
        """Unmap now, or, while a pin (``array``) or view is still held, once the last one goes."""
        self.array = None
        try:
            self._mm.close()
        except BufferError:  # a pinned view is in use: the map is freed when it and this object go
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._unlink:
            try:
                os.unlink(self._unlink)
            except FileNotFoundError:
                pass
            self._unlink = None


def allocate(nbytes: int, backend: str = "memfd") -> Mapping:
    """New zero-filled shared memory of ``nbytes``. memfd: peers open /proc/<pid>/fd/<n>; posix: a
    /dev/shm file named from pid + random, unlinked on close (memfd falls back to posix where memfd_create
    is refused). Raises OSError if the kernel refuses the memory."""
    if backend == "memfd" and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(f"kvp-{os.getpid()}", 0)
        except OSError:  # e.g. a seccomp filter: POSIX shm below still works
            pass
        else:
            return _mapped(fd, nbytes, f"/proc/{os.getpid()}/fd/{fd}", None)
    path = f"/dev/shm/kvp-{os.getpid()}-{secrets.token_hex(8)}"
    return _mapped(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), nbytes, path, path)


def _mapped(fd: int, nbytes: int, path: str, unlink: str | None) -> Mapping:
    try:
        os.fchmod(fd, 0o600)     # owner only (a memfd starts 0777): other users can neither read nor write it
        os.ftruncate(fd, nbytes)
        return Mapping(fd, nbytes, path, unlink=unlink)
    except BaseException:
        os.close(fd)
        if unlink:
            os.unlink(unlink)
        raise


def open_remote(path: str, length: int) -> Mapping:
    """Map a peer's shared region. Raises TransferFailed if it cannot be opened or is shorter than
    ``length`` (mapping past the end of a file would fault on access)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise TransferFailed(f"cannot open peer shared memory {path}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size < length:
            raise TransferFailed(f"peer shared memory {path} has {size} bytes, descriptor says {length}")
        return Mapping(fd, length, path, keep_fd=False)
    except BaseException:
        os.close(fd)
        raise
