"""Settings of the kvplugins kt expert backend that kt-kernel's constructor has no argument for."""

from __future__ import annotations

import dataclasses

from kvplugins.config import component


@component("kt")
@dataclasses.dataclass(frozen=True)
class KTConfig:
    isa: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "kernel tier: auto (the widest this CPU runs), amx, avx512_bf16, avx512, avx512_base, avx2 "
            "or scalar; a lower tier can be forced, one the CPU lacks is refused"
        },
    )
    spin_us: int = dataclasses.field(
        default=200, metadata={"help": "µs an idle worker polls for work before it sleeps (0 = sleep at once)"}
    )
    sync_spin_us: int = dataclasses.field(
        default=5000,
        metadata={
            "help": "µs sync_forward polls for the layer's job before it sleeps (0 = sleep at once): polling keeps one "
            "core busy while waiting but skips the sleeping thread's wake-up (25-70 µs per decode forward "
            "measured in a VM)"
        },
    )
    int4_group: int = dataclasses.field(
        default=128,
        metadata={"help": "inputs per int4 scale when quantizing online (load_weights_from_tensors); multiple of 64"},
    )
    staging: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto: GPU callers take the stream-ordered path (pinned buffers, host functions on their CUDA "
            "stream, CUDA-graph safe), CPU callers the direct one; always: CPU callers take the stream path "
            "too, through its CPU ordering shim (tests the GPU path on a CPU)"
        },
    )
    numa_sysfs: str = dataclasses.field(
        default="/sys/devices/system/node",
        metadata={"help": "directory with node<N>/cpulist, where subpools find their NUMA node's CPUs (sysfs)"},
    )

    def __post_init__(self):
        for name in ("spin_us", "sync_spin_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.staging not in ("auto", "always"):
            raise ValueError(f"staging must be 'auto' or 'always' (got {self.staging!r})")
        if self.int4_group < 64 or self.int4_group % 64:
            raise ValueError(f"int4_group must be a positive multiple of 64 (got {self.int4_group})")
