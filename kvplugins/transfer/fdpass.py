"""Shared memory handed to same-host peers as a file descriptor (issue #30 item 1), never as a path.

A process that exports alloc_shared memory serves its regions' memfds on an abstract Unix socket
(``kvp-fd-<pid>-<random>``, named in its shm endpoint). A peer connects, the kernel tells each side who the other
is (SO_PEERCRED), and the owner sends the region's fd with SCM_RIGHTS; the peer maps that fd. So a peer never
opens a path a descriptor named (a descriptor naming a regular file, another process's memory or a symlink gets
nothing), and it can only ever map memory that its owner held and chose to hand over.

Checks, owner side: the peer's uid is the owner's (another user gets nothing, as the memfd's 0600 mode said
before). Peer side: the socket name has the expected form, the process serving it is the descriptor's pid and
runs under the peer's own uid, the fd is a memfd sealed against shrinking and growing (F_SEAL_SHRINK |
F_SEAL_GROW, so the owner cannot truncate it under a mapping and make the peer fault with SIGBUS) and holds at
least the region's length. Anything else raises TransferFailed naming what did not hold. Memory without those
seals (the posix backend) is not handed out: peers reach it over TCP.

Wire: the peer sends the region id (u64 LE); the owner answers the region's length (u64 LE, 0 = unknown region)
with the fd attached, or 0 and no fd.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import re
import secrets
import socket
import stat
import struct
import threading

from kvplugins.errors import TransferFailed
from kvplugins.transfer.sockio import recv_exact

log = logging.getLogger("kvplugins.transfer")
NAME = re.compile(r"kvp-fd-[0-9]{1,10}-[0-9a-f]{16}")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
TIMEOUT_S = 2.0
_U64 = struct.Struct("<Q")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of Unix socket ``sock``, as the kernel recorded it."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def seal(fd: int) -> None:
    """Seal memfd ``fd`` (created with MFD_ALLOW_SEALING, already sized) against shrinking, growing and new seals."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)


def sealed(fd: int) -> bool:
    """Whether ``fd`` is shared memory that can be neither shrunk nor grown."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:  # not shmem (a regular file, a pipe...)
        return False


class FdServer:
    """Hands the fds of this process's shared regions to same-user peers on an abstract Unix socket."""

    def __init__(self):
        self.name = f"kvp-fd-{os.getpid()}-{secrets.token_hex(8)}"
        self._fds: dict[int, tuple[int, int]] = {}  # region id -> (fd, length)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="kvp-fd-server", daemon=True)
        self._thread.start()

    def offer(self, region_id: int, fd: int, length: int) -> None:
        """Hand ``fd`` (sealed memfd of ``length`` bytes) to peers asking for ``region_id``."""
        with self._lock:
            self._fds[region_id] = (fd, length)

    def withdraw(self, region_id: int) -> None:
        with self._lock:
            self._fds.pop(region_id, None)

    def close(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop:
                    return
                continue
            with conn:
                try:
                    self._answer(conn)
                except OSError as e:
                    log.debug("fd request failed: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT_S)
        if peer_cred(conn)[1] != os.getuid():
            return  # another user: nothing, not even an answer
        request = recv_exact(conn, _U64.size)
        with self._lock:
            got = self._fds.get(_U64.unpack(request)[0])
        if got is None:
            conn.sendall(_U64.pack(0))
            return
        fd, length = got
        conn.sendmsg([_U64.pack(length)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def fetch(name: str, pid: int, region_id: int, length: int) -> int:
    """The fd of region ``region_id`` (``length`` bytes) of the process ``pid`` serving abstract socket ``name``;
    the caller owns (closes) it. Raises TransferFailed naming the check that failed."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise TransferFailed(f"shm endpoint names no fd socket of the form kvp-fd-<pid>-<hex> ({name!r:.80})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(TIMEOUT_S)
        try:
            s.connect("\0" + name)
            who = peer_cred(s)
            if who != (pid, os.getuid()):
                raise TransferFailed(
                    f"fd socket {name} is served by pid {who[0]} uid {who[1]}, not the peer's pid "
                    f"{pid} under this uid {os.getuid()}"
                )
            s.sendall(_U64.pack(region_id))
            data, anc, _, _ = s.recvmsg(_U64.size, socket.CMSG_SPACE(4))
        except OSError as e:
            raise TransferFailed(f"fd socket {name} of pid {pid}: {e}") from e
    fds = [
        fd
        for level, kind, raw in anc
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        for fd in array.array("i", raw[: len(raw) - len(raw) % 4])
    ]
    if len(data) != _U64.size or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise TransferFailed(f"pid {pid} handed no shared memory for region {region_id}")
    return _checked(fds[0], length, pid, region_id)


def _checked(fd: int, length: int, pid: int, region_id: int) -> int:
    st = os.fstat(fd)
    why = (
        "it is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else "it is not memory sealed against shrinking (a memfd with F_SEAL_SHRINK | F_SEAL_GROW)"
        if not sealed(fd)
        else f"it has {st.st_size} bytes, the descriptor says {length}"
        if st.st_size < length
        else ""
    )
    if why:
        os.close(fd)
        raise TransferFailed(f"pid {pid} handed an fd for region {region_id} that cannot be mapped: {why}")
    return fd
