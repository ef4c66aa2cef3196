"""Device memory (a GPU's) in the transfer core (issue #36): which addresses are device memory, and the copy
functions that stage it through host memory (Region.device, api.DeviceMemory).

No transport touches device memory directly: no dmabuf/GPUDirect MR is implemented. A peer reaches an exported
device region over TCP only, where the owner's server copies each frame between the region and a host buffer
(native/src/tcp/server.cpp); the owner's own batches take host memory, so a caller with device buffers copies
them through registered host memory first (kvplugins/mooncake/te_device.py). Mooncake's TCP transport does the
same (cudaMemcpy around each slice).

The CUDA runtime is the libcudart this process loaded already (torch's): nothing here loads or initializes CUDA
in a process that has not. ``emulated()`` stands in for it on machines without a GPU (config
``device_emulation``): host memory, copied by native host functions with cudaMemcpy's signature.
"""

from __future__ import annotations

import ctypes
import os

from kvplugins.errors import ConfigError, TransferFailed
from kvplugins.transfer.api import DeviceMemory

_CUDART = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")
HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
_DEVICE = 2  # cudaMemoryTypeDevice (0 unregistered, 1 host, 3 managed: host code may touch those)
_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)


class _PointerAttributes(ctypes.Structure):  # cudaPointerAttributes (CUDA >= 11)
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("dev", ctypes.c_void_p), ("host", ctypes.c_void_p)]


def cuda_runtime(load: bool = False) -> ctypes.CDLL | None:
    """The CUDA runtime library (libcudart, as torch's CUDA build loads it) this process has loaded already, or
    None; ``load``: load it where it is not loaded yet (None where it cannot be found)."""
    mode = ctypes.DEFAULT_MODE if load else os.RTLD_NOLOAD | os.RTLD_LAZY
    for name in _CUDART:
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    return None


def cuda(index: int) -> DeviceMemory:
    """CUDA device ``index``'s copy functions. Raises ConfigError where no CUDA runtime is loaded."""
    lib = cuda_runtime()
    if lib is None:
        raise ConfigError(
            f"device memory on cuda:{index}: this process has no CUDA runtime loaded (libcudart, as torch's CUDA "
            "build loads it); register host memory, or set transfer device_emulation for a test without a GPU"
        )
    fn = ctypes.c_void_p
    return DeviceMemory(
        "cuda", int(index), ctypes.cast(lib.cudaSetDevice, fn).value or 0, ctypes.cast(lib.cudaMemcpy, fn).value or 0
    )


def emulated(index: int = 0) -> DeviceMemory:
    """Host memory treated as device ``index``'s (tests without a GPU): native host copies."""
    from kvplugins import _tcp

    set_device, memcpy = _tcp.emulated_device_fns()
    return DeviceMemory("emulated", int(index), int(set_device), int(memcpy))


def device_of(addr: int) -> int | None:
    """The CUDA device index of ``addr`` when it is device memory, else None (host, managed or unknown memory, or
    no CUDA runtime loaded)."""
    lib = cuda_runtime()
    if lib is None:
        return None
    attrs = _PointerAttributes()
    if lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(int(addr))) != 0:
        lib.cudaGetLastError()  # CUDA < 11 answers a host pointer with an error: clear it
        return None
    return int(attrs.device) if attrs.type == _DEVICE else None


def for_location(location: str, addr: int, emulate: bool) -> DeviceMemory | None:
    """The device memory Mooncake's ``location`` names for ``addr`` ("cuda:N"; "*" or "" detects it; "cpu:N"
    is host memory), or None for host memory. ``emulate`` (config device_emulation): "cuda:N" and "*" are
    emulated device memory. Raises ConfigError for another location or a CUDA location without a CUDA runtime."""
    loc = (location or "*").strip()
    if loc == "*" and emulate:
        return emulated(0)
    if loc == "*":
        index = device_of(addr)
        return None if index is None else cuda(index)
    kind, _, num = loc.partition(":")
    if kind == "cpu":
        return None
    if kind == "cuda" and (num == "" or num.isdigit()):
        return (emulated if emulate else cuda)(int(num or 0))
    raise ConfigError(f"memory location {location!r}: use '*' (detect), 'cpu:N' or 'cuda:N'")


def copy(device: DeviceMemory, dst: int, src: int, nbytes: int, kind: int) -> None:
    """Copy ``nbytes`` between host and ``device`` memory (kind HOST_TO_DEVICE or DEVICE_TO_HOST); the GIL is
    released meanwhile. Raises TransferFailed with the runtime's error code."""
    rc = _SET(device.set_device_fn)(device.index)
    if rc == 0:
        rc = _COPY(device.memcpy_fn)(dst, src, nbytes, kind)
    if rc != 0:
        way = "host to device" if kind == HOST_TO_DEVICE else "device to host"
        raise TransferFailed(f"{way} copy of {nbytes} bytes on {device.kind}:{device.index} failed (error {rc})")
