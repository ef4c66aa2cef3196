"""Shared memory that same-host peers can map: allocation (memfd or POSIX shm), mapping, host identity.

Page faults: the first write to a fresh 4 KiB page of a mapping costs a fault (and, for the owner, a page
allocation), which made the first copy into a new segment run at a fifth of memcpy speed. So the owner
populates its allocation up front (MADV_POPULATE_WRITE, Linux >= 5.14: the memory is committed when the segment
starts, or allocate raises), and a peer's mapping is populated by a background thread after it is opened.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import secrets
import socket
import threading

import numpy as np

from kvplugins.transfer import fdpass

log = logging.getLogger("kvplugins.transfer")
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14); not exported by Python 3.11's mmap module
_POPULATE_CHUNK = 64 << 20  # a background populate takes the region in steps this big


@functools.lru_cache(maxsize=1)
def _madvise():
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def populate_pages(addr: int, length: int) -> bool:
    """Fault in (and for holes, allocate) every page of [addr, addr+length) of a writable shared mapping, with
    the GIL released (ctypes). Returns False where the kernel has no MADV_POPULATE_WRITE (nothing done).
    Raises OSError (ENOMEM: no memory for the pages, EFAULT: not mapped)."""
    if _madvise()(addr, length, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {length} bytes: {os.strerror(err)}")


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
        self.length, self.path, self._unlink, self.fd = length, path, unlink, fd
        self._mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if not keep_fd:  # the map keeps the memory; the owner keeps its fd to hand it to peers (fdpass.py)
            os.close(fd)
            self.fd = -1
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)

    def populate_in_background(self) -> None:
        """Populate this mapping's pages from a daemon thread (a peer's region: its owner already allocated
        them, so this only maps them here), one chunk at a time; it holds a pin, so close() waits for it to
        let go of the memory. Failures only log: a page not populated faults on first use as before."""
        pin = self.array
        if pin is not None:
            threading.Thread(
                target=_populate_chunks, args=(pin, self.path), daemon=True, name="kvp-shm-populate"
            ).start()

    def close(self) -> None:
        """Unmap now, or, while a pin (``array``) or view is still held, once the last one goes."""
        self.array = None
        try:
            self._mm.close()
        except BufferError:  # a pinned view is in use: the map is freed when it and this object go
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._unlink:
            try:
                os.unlink(self._unlink)
            except FileNotFoundError:
                pass
            self._unlink = None


def allocate(nbytes: int, backend: str = "memfd", populate: bool = True) -> Mapping:
    """New zero-filled shared memory of ``nbytes``, its pages populated (committed) now unless ``populate`` is
    False. memfd: sealed against shrinking and growing, handed to same-host peers as an fd (fdpass.py); posix: a
    /dev/shm file named from pid + random, unlinked on close, which cannot be sealed and so is not handed out
    (peers use TCP; memfd falls back to posix where memfd_create is refused). ``Mapping.path`` names where it
    lives, for logs; no peer opens it. Raises OSError if the kernel refuses the memory."""
    if backend == "memfd" and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(f"kvp-{os.getpid()}", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        except OSError:  # e.g. a seccomp filter: POSIX shm below still works
            pass
        else:
            return _mapped(fd, nbytes, f"/proc/{os.getpid()}/fd/{fd}", None, populate)
    path = f"/dev/shm/kvp-{os.getpid()}-{secrets.token_hex(8)}"
    return _mapped(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), nbytes, path, path, populate)


def _populate_chunks(pin: np.ndarray, path: str) -> None:
    addr, n = int(pin.ctypes.data), len(pin)
    try:
        for off in range(0, n, _POPULATE_CHUNK):
            if not populate_pages(addr + off, min(_POPULATE_CHUNK, n - off)):
                return
    except OSError as e:
        log.debug("populating the mapping of %s stopped: %s", path, e)


def _mapped(fd: int, nbytes: int, path: str, unlink: str | None, populate: bool) -> Mapping:
    try:
        os.fchmod(fd, 0o600)  # owner only (a memfd starts 0777): other users can neither read nor write it
        os.ftruncate(fd, nbytes)
        if unlink is None:
            fdpass.seal(fd)  # a peer's mapping can never be cut short under it (SIGBUS)
        m = Mapping(fd, nbytes, path, unlink=unlink)
    except BaseException:
        os.close(fd)
        if unlink:
            os.unlink(unlink)
        raise
    try:
        if populate:
            populate_pages(m.addr, nbytes)
    except OSError as e:
        m.close()
        raise OSError(
            e.errno,
            f"cannot commit {nbytes} bytes of shared memory ({e.strerror}); "
            "lower the segment or buffer size, or free memory",
        ) from e
    return m


def map_fd(fd: int, length: int, label: str) -> Mapping:
    """Map ``length`` bytes of a peer's shared memory from ``fd`` (fdpass.fetch checked it; the mapping takes
    it over and closes it); its pages are mapped in by a background thread (populate_in_background)."""
    try:
        m = Mapping(fd, length, label, keep_fd=False)
    except BaseException:
        os.close(fd)
        raise
    m.populate_in_background()
    return m
