#!/usr/bin/env python3
"""GPU <-> host copy rates into our kind of shared memory (issue #14 groundwork; needs torch with CUDA).

Can CUDA pin (``cudaHostRegister``) a MAP_SHARED memfd mapping, the memory of a kvplugins shm segment or staging
buffer, and how fast do device-to-host and host-to-device copies of 1 GiB run into it, next to torch's pinned
(cudaHostAlloc) and pageable memory? Also checks that a second mapping of the memfd (a peer process's view)
sees the bytes a D2H copy wrote. Prints one line per case; GB = 1e9 bytes, median of 10 copies.

  python3 benchmarks/gpu_pin_probe.py
"""

import json
import mmap
import os
import time

import numpy as np
import torch

N = 1 << 30


def bench(dev: torch.Tensor, host: torch.Tensor, label: str, reps: int = 10) -> None:
    out = {}
    for name, fn in (
        ("d2h", lambda: host.copy_(dev, non_blocking=True)),
        ("h2d", lambda: dev.copy_(host, non_blocking=True)),
    ):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        out[name] = round(N / sorted(ts)[reps // 2] / 1e9, 2)
    print(f"{label:36s} GB/s {json.dumps(out)}", flush=True)


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), flush=True)
    dev = torch.empty(N, dtype=torch.uint8, device="cuda").random_(0, 255)
    bench(dev, torch.empty(N, dtype=torch.uint8, pin_memory=True), "torch pinned (cudaHostAlloc)")
    bench(dev, torch.empty(N, dtype=torch.uint8), "pageable")
    fd = os.memfd_create("kvp-probe", 0)
    os.ftruncate(fd, N)
    mm = mmap.mmap(fd, N, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr[::4096] = 0  # fault the pages in
    host = torch.from_numpy(arr)
    bench(dev, host, "memfd MAP_SHARED, not registered")
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(host.data_ptr(), N, 0))
    print("cudaHostRegister(memfd MAP_SHARED) rc", rc, flush=True)
    if rc == 0:
        bench(dev, host, "memfd MAP_SHARED, registered")
        host.copy_(dev)
        torch.cuda.synchronize()
        other = mmap.mmap(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR), N, mmap.MAP_SHARED)
        same = bytes(other[-4096:]) == dev[-4096:].cpu().numpy().tobytes()
        print("second mapping sees the D2H bytes:", same, flush=True)
        print("cudaHostUnregister rc", int(cudart.cudaHostUnregister(host.data_ptr())), flush=True)


if __name__ == "__main__":
    main()
