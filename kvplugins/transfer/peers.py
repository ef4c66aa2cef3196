"""Same-host peer processes watched through a pidfd each, for the transports that copy straight into or out of a
peer's memory (shm.py, cma.py): a peer that exited gives TransferFailed rather than writes into memory nobody
reads, and (with the start time it published) a pid reused by another process is never taken for the peer.

One pidfd per segment, opened on first use and kept (poll, not select: fds above FD_SETSIZE are fine); where the
kernel has no pidfd (ENOSYS), /proc/<pid> tells whether the process exists.
"""

from __future__ import annotations

import errno
import os
import select
import threading

from kvplugins.errors import TransferFailed


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot (/proc/<pid>/stat field 22), or None when
    there is no such process. With the pid it names one process for the life of the boot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])  # fields after "(comm)" start at field 3


class PeerWatch:
    """The peers of one transport (``name``, for messages), by segment id. Thread-safe."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._pidfds: dict[str, tuple[int, select.poll | None]] = {}  # segment -> (pidfd or -1, its poll object)

    def check(self, segment_id: str, pid: int, start: object = None) -> None:
        """Raise TransferFailed unless process ``pid`` of segment ``segment_id`` is alive and, with ``start``,
        still the process that published that start time (checked once, after opening its pidfd)."""
        poller = self._poller(segment_id, pid, start)
        alive = os.path.exists(f"/proc/{pid}") if poller is None else not poller.poll(0)
        if not alive:
            raise self._gone(segment_id, pid, "has exited")

    def exited(self, segment_id: str, pid: int) -> TransferFailed | None:
        """After a copy: the TransferFailed of a peer that exited since ``check`` (the copy may have missed it),
        else None."""
        with self._lock:
            got = self._pidfds.get(segment_id)
        poller = got[1] if got is not None else None
        if poller is not None and poller.poll(0):
            return self._gone(segment_id, pid, "exited during the transfer")
        return None

    def pidfd(self, segment_id: str) -> int:
        """The pidfd watching ``segment_id``'s process (opened by ``check``), or -1 (not checked yet, or no pidfd on
        this kernel). Stays this table's: a holder beyond the next ``forget`` duplicates it."""
        with self._lock:
            return self._pidfds.get(segment_id, (-1, None))[0]

    def forget(self, segment_id: str) -> None:
        """Close the pidfd of ``segment_id`` (the next check opens a new one)."""
        with self._lock:
            fd, _ = self._pidfds.pop(segment_id, (-1, None))
        if fd >= 0:
            os.close(fd)

    def _poller(self, segment_id: str, pid: int, start: object) -> select.poll | None:
        with self._lock:
            got = self._pidfds.get(segment_id)
        if got is not None:
            return got[1]
        try:
            fd = os.pidfd_open(pid)
        except OSError as e:
            if e.errno != errno.ENOSYS:
                raise TransferFailed(f"{self._name} peer {segment_id} (pid {pid}) is gone: {e.strerror}") from e
            fd, poller = -1, None
        else:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
        if start is not None and start_time(pid) != start:  # after pidfd_open: the pidfd then names that process
            if fd >= 0:
                os.close(fd)
            raise self._gone(segment_id, pid, "has exited")
        with self._lock:
            got = self._pidfds.setdefault(segment_id, (fd, poller))
        if got[0] != fd and fd >= 0:  # another thread opened one first
            os.close(fd)
        return got[1]

    def _gone(self, segment_id: str, pid: int, what: str) -> TransferFailed:
        return TransferFailed(f"{self._name} peer {segment_id} (pid {pid}) {what}")

    def close(self) -> None:
        with self._lock:
            fds = [fd for fd, _ in self._pidfds.values()]
            self._pidfds.clear()
        for fd in fds:
            if fd >= 0:
                os.close(fd)
