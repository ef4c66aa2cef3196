"""Thin wrapper over the nanobind module ``kvplugins._moe`` (native/src/moe/): names instead of enums, and native
``ValueError``/``RuntimeError`` turned into kvplugins errors. Arrays (numpy, or torch tensors via DLPack) are read
in place; nothing here imports torch.

Formats: ``bf16`` (bf16 dot products), ``int8`` (per output channel, VNNI on AVX-512), ``int4`` (symmetric, one
scale per ``group`` inputs, VNNI on unpacked nibbles). ISA tiers, narrowest first: ``scalar``; ``avx2`` (AVX2 +
FMA); ``avx512_base`` (F/BW/VL/DQ: Skylake-SP; int8/int4 on vpmaddubsw with the sign trick, exact); ``avx512``
(that + VNNI: Ice Lake, Cascade Lake; bf16 widened to fp32 + FMA); ``avx512_bf16`` (that +
AVX512-BF16: Cooper Lake, Sapphire Rapids, Zen 4/5); ``amx`` (that + AMX tiles for prefill: Sapphire
Rapids and newer). ``auto`` picks the widest this CPU and OS run (cpuid + XGETBV, and for AMX the kernel's
permission for tile data); a named tier the CPU lacks is refused (never SIGILL). ``amx_emulated`` (tests only,
never picked by ``auto``): the amx tier's code with its tile instructions done in scalar C++, so CI checks its
packing and tiling on CPUs without AMX.
"""

from __future__ import annotations

from kvplugins.errors import ConfigError, NativeError

FORMATS = ("bf16", "int8", "int4")
ISAS = ("scalar", "avx2", "avx512_base", "avx512", "avx512_bf16", "amx")
EMULATED = "amx_emulated"  # index len(ISAS) in the native enum
PROJ = {"gate": 0, "up": 1, "down": 2}
NODE_ROOT = "/sys/devices/system/node"


def _mod():
    try:
        from kvplugins import _moe
    except ImportError as e:  # pragma: no cover - a broken install
        raise NativeError(f"kvplugins MoE module is not built ({e}); reinstall with `pip install .`") from e
    return _moe


def best_isa() -> str:
    """The widest kernel tier this CPU and OS can run: amx, avx512_bf16, avx512, avx512_base, avx2 or scalar."""
    return _mod().best_isa()


def best_isa_reason() -> str:
    """Why best_isa() is that tier, e.g. "AVX512 F/BW/VL/DQ + VNNI, no AVX512-BF16 (bf16 weights widen to fp32)"."""
    return _mod().best_isa_reason()


def kt_cpu_variant() -> str:
    """best_isa() in kt-kernel's ``__cpu_variant__`` names: amx, avx512_bf16, avx512_vnni (our ``avx512`` tier),
    avx512_base, avx2; scalar has no kt-kernel variant and keeps its name. Source: kt-kernel 0.7.2 kt_kernel/_cpu_detect.py."""
    best = best_isa()
    return "avx512_vnni" if best == "avx512" else best


def describe_isa(name: str = "auto") -> str:
    """The tier ``name`` resolves to here and why, for logs and ``kvplugins kt status``. Raises ConfigError as
    resolve_isa."""
    tier = resolve_isa(name)
    why = best_isa_reason() if name == "auto" else f"forced (isa={name}); widest here {best_isa()}"
    return f"{tier} ({why})"


def supported_isas(emulated: bool = False) -> list[str]:
    """Every tier this CPU and OS can run, narrowest first; ``emulated``: with ``amx_emulated`` last where it runs
    (CPUs with the avx512 tier)."""
    names = [name for i, name in enumerate(ISAS) if _mod().isa_supported(i)]
    return names + [EMULATED] if emulated and _mod().isa_supported(len(ISAS)) else names


def resolve_isa(name: str) -> str:
    """``auto`` -> best_isa(); a named ISA (or ``amx_emulated``) is checked. Raises ConfigError naming the
    choices."""
    if name == "auto":
        return best_isa()
    if name not in ISAS and name != EMULATED:
        raise ConfigError(f"isa {name!r} is not one of auto, {', '.join(ISAS)}")
    if not _mod().isa_supported(_index(name)):
        raise ConfigError(
            f"this CPU cannot run the {name} kernels (best here: {best_isa()}: {best_isa_reason()}); "
            f"use isa=auto or one of {', '.join(supported_isas())} (KVPLUGINS_KT_ISA)"
        )
    return name


def _index(name: str) -> int:
    return len(ISAS) if name == EMULATED else ISAS.index(name)


def _call(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    except RuntimeError as e:
        raise NativeError(str(e)) from e


def _call_arrays(fn, name, *args):
    """A forward/submit call; nanobind's TypeError for an array it may not convert becomes a ConfigError."""
    try:
        return _call(fn, *args)
    except TypeError as e:
        raise ConfigError(
            f"{name}: pass C-contiguous CPU arrays of the documented dtypes (x bf16 or float32, ids "
            f"int64, weights and out float32), e.g. .contiguous() tensors: {e}"
        ) from e


class Pool:
    """``threads`` compute threads in ``subpools`` groups; subpool s is pinned to NUMA node ``nodes[s]`` when that
    node exists (empty ``nodes``: no pinning). Idle workers poll for ``spin_us`` µs, then sleep; ``wait`` polls
    for its job for up to ``wait_spin_us`` µs, then sleeps. Node CPUs are read from ``node_root``/node<N>/cpulist
    (sysfs; tests pass a fake topology)."""

    def __init__(
        self,
        threads: int,
        subpools: int = 1,
        nodes: list[int] | None = None,
        spin_us: int = 200,
        node_root: str = NODE_ROOT,
        wait_spin_us: int = 0,
    ):
        self._p = _call(
            _mod().Pool, int(threads), int(subpools), list(nodes or []), int(spin_us), int(wait_spin_us), str(node_root)
        )

    @property
    def threads(self) -> int:
        return self._p.threads

    def describe(self) -> str:
        return self._p.describe()

    def wait(self, ticket: int) -> None:
        """Block (GIL released) until job ``ticket`` finished; re-raises its error as ConfigError/NativeError."""
        _call(self._p.wait, ticket)


class Layer:
    """The routed experts of one MoE layer: E experts of gate/up [I, H] and down [H, I] in one format.

    H and I must be multiples of 64; int4 ``group`` a multiple of 64 dividing both. Raises ConfigError.
    """

    def __init__(self, fmt: str, experts: int, hidden: int, inter: int, group: int = 128, isa: str = "auto"):
        if fmt not in FORMATS:
            raise ConfigError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
        m = _mod()
        self.format, self.isa, self.group = fmt, resolve_isa(isa), int(group)
        self.experts, self.hidden, self.inter = int(experts), int(hidden), int(inter)
        self._l = _call(
            m.Layer,
            m.Format(FORMATS.index(fmt)),
            self.experts,
            self.hidden,
            self.inter,
            self.group,
            m.Isa(_index(self.isa)),
        )
        self._last = None  # (pool, ticket) of the newest queued job: the weights must outlive it

    def __del__(self):
        last, self._last = getattr(self, "_last", None), None
        if last is not None:
            try:
                last[0].wait(last[1])
            except Exception:  # noqa: BLE001 - its error was (or will be) reported to its own waiter
                pass

    def set_float(self, pool: Pool, expert: int, proj: str, weight) -> None:
        """Quantize one projection of ``expert`` from a [rows, cols] bf16 (or uint16 bits) / float32 array:
        gate, up [I, H]; down [H, I]. Rows are first touched by the subpool that will read them."""
        _call(self._l.set_float, pool._p, int(expert), PROJ[proj], weight)

    def set_quantized(self, pool: Pool, expert: int, proj: str, q, scale) -> None:
        """Load one projection already in this layer's format (``quantize``'s output / the convert format);
        ``scale`` is None for bf16."""
        if scale is None:
            import numpy as np

            scale = np.zeros((0, 0), np.float32)
        _call(self._l.set_quantized, pool._p, int(expert), PROJ[proj], q, scale)

    def loaded(self, expert: int) -> bool:
        return self._l.loaded(int(expert))

    def forward(self, pool: Pool, x, ids, weights, skip, out, accumulate: bool = False) -> None:
        """out[T, H] float32 (+)= sum_k weights[t, k] * expert_{ids[t, k]}(x[t]); x [T, H] bf16 or float32,
        ids [T, K] int64 (-1 = none), weights [T, K] float32, skip [E] uint8/bool or None (nonzero = skipped,
        e.g. on the GPU). Blocks with the GIL released. Raises ConfigError on bad shapes, ids or unloaded experts,
        and when ``out`` is not a C-contiguous float32 array (a converted copy would receive the result)."""
        _call_arrays(self._l.forward, "forward", pool._p, x, ids, weights, skip, out, bool(accumulate))

    def submit(self, pool: Pool, x, ids, weights, skip, out, accumulate: bool = False) -> int:
        """forward() queued on the pool's job thread; returns a ticket for Pool.wait. The caller must keep every
        array alive and unchanged until that wait returns. The layer itself waits for its last job when freed.
        Every array must already be C-contiguous with its dtype (ConfigError otherwise): the job would read a
        converted copy freed when submit returns."""
        ticket = _call_arrays(self._l.submit, "submit", pool._p, x, ids, weights, skip, out, bool(accumulate))
        self._last = (pool, ticket)
        return ticket


def quantize(fmt: str, weight, group: int = 128):
    """Quantize a [N, K] bf16/float32 array: returns numpy (q, scale). bf16: q uint16 bits [N, K]; int8: q int8
    [N, K], scale [N, 1]; int4: q uint8 [N, K/2] (64-element blocks, byte j = q[j]+8 | (q[j+32]+8) << 4), scale
    [N, K/group]. Symmetric: int8 scale = amax/127, int4 scale = amax/7 per group."""
    if fmt not in FORMATS:
        raise ConfigError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
    return _call(_mod().quantize, FORMATS.index(fmt), weight, int(group))


def dequantize(fmt: str, q, scale, group: int = 128):
    """Inverse of quantize() as float32 numpy [N, K] (for references and tests)."""
    import numpy as np

    if fmt == "bf16":
        return (np.asarray(q, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if fmt == "int8":
        return np.asarray(q, np.float32) * np.asarray(scale, np.float32)
    q = np.asarray(q, np.uint8)
    n, half = q.shape
    blocks = q.reshape(n, half // 32, 32)
    vals = np.concatenate([blocks & 15, blocks >> 4], axis=2).reshape(n, half * 2).astype(np.float32) - 8
    return vals * np.repeat(np.asarray(scale, np.float32), group, axis=1)


def host_functions() -> tuple[int, int]:
    """Addresses of the native ``void fn(void*)`` host functions (submit, wait) a CUDA stream calls on a HostJob's
    ``handle`` (cudaLaunchHostFunc; also what kvplugins.kt_expert_backend.stream.HostOrder calls on the CPU)."""
    m = _mod()
    return int(m.host_submit_fn), int(m.host_wait_fn)


class HostJob:
    """A forward of ``layer`` on ``pool`` bound to fixed arrays (as Layer.submit's), started and awaited by the host
    functions of host_functions() on ``handle``; ``keep``: objects kept alive with the job. The arrays' contents
    may change between runs, never their addresses. Raises ConfigError for bad shapes or dtypes."""

    def __init__(self, layer: Layer, pool: Pool, x, ids, weights, skip, out, accumulate: bool, keep):
        self._j = _call_arrays(
            _mod().HostJob, "HostJob", layer._l, pool._p, x, ids, weights, skip, out, bool(accumulate), keep
        )
        self.handle = int(self._j.handle)

    def take_error(self) -> str:
        """What a host function of this job caught since the last call ('' if nothing), cleared."""
        return self._j.take_error()
