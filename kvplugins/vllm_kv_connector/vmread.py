"""P/D direct path on one host: copy a producer's KV blocks straight out of its memory with Linux
``process_vm_readv`` (one system call per 1024 spans), so no thread of the producer has to run for the read.

Why: vLLM's KV tensors are ordinary memory (no shm path), so the transfer core reads them over TCP, served by
Python threads inside the producer's worker. While the producer holds a handed-over request's blocks, its
engine steps continuously and the worker's main thread busy-polls vLLM's message queue (sched_yield) holding the
GIL between polls; on a CPU-starved host (measured: CPU pressure "some" 85%) those server threads did not answer
a 7 MB read within the 10 s timeout (tests/vllm/test_pd_e2e.py, the full tests/vllm run). Needs the same user (or
CAP_SYS_PTRACE) and a ptrace policy that allows it (Yama ptrace_scope 0, or 1 for a parent); any failure returns
False and the caller falls back to the transfer core. Bytes read are used only if the producer's lease word still
holds the request's token afterwards (pd.Reader), so a wrong or reused process id never yields wrong tokens.
"""
from __future__ import annotations

import ctypes
import functools
import os

IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def _syscall():
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "process_vm_readv", None)
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def read(pid: int, spans: list[tuple[int, int, int]]) -> str | None:
    """Copy each span ``(local address, remote address, bytes)`` from process ``pid``; None when every byte
    arrived, else the reason (errno text, or a short read) — the caller then reads another way."""
    fn = _syscall()
    if fn is None:
        return "process_vm_readv is not available here"
    for i in range(0, len(spans), IOV_MAX):
        chunk = spans[i:i + IOV_MAX]
        local = (_Iovec * len(chunk))(*[(a, n) for a, _, n in chunk])
        remote = (_Iovec * len(chunk))(*[(r, n) for _, r, n in chunk])
        want = sum(n for _, _, n in chunk)
        got = fn(int(pid), ctypes.addressof(local), len(chunk), ctypes.addressof(remote), len(chunk), 0)
        if got != want:
            err = ctypes.get_errno()
            return os.strerror(err) if got < 0 else f"short read ({got} of {want} bytes)"
    return None
