"""``--kt-method`` names (kt-kernel 0.7.2's INFERENCE_METHODS) mapped to our kernels.

Each accepted name maps to the nearest kvplugins weight format, with a note logged once per name; the others are
refused with an error listing the accepted names. The kernel tier (``isa``, native.py) is chosen separately: on
an AMX CPU the ``amx`` tier runs prefill on AMX tiles, whatever the method's name; elsewhere AMX*
names run the AVX512-VNNI kernels of the same precision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvplugins.errors import ConfigError

log = logging.getLogger("kvplugins.kt")


@dataclass(frozen=True)
class Method:
    name: str  # as given to --kt-method
    format: str  # kvplugins weight format: bf16 | int8 | int4
    note: str  # why this kernel; logged once


_ACCEPTED = {
    "BF16": ("bf16", "BF16 -> kvplugins bf16 kernel (AVX512-BF16 dot products; AVX2/scalar fallback)"),
    "AMXINT8": ("int8", "AMXINT8 -> kvplugins int8 per-channel kernel (AMX prefill on the amx tier, else AVX512-VNNI)"),
    "AMXINT4": (
        "int4",
        "AMXINT4 -> kvplugins int4 group-quantized kernel (AMX prefill on the amx tier, else AVX512-VNNI)",
    ),
    "MOE_INT8": ("int8", "MOE_INT8 -> kvplugins int8 per-channel kernel (AVX512-VNNI)"),
    "MOE_INT4": ("int4", "MOE_INT4 -> kvplugins int4 group-quantized kernel (AVX512-VNNI)"),
    "RAWINT4": (
        "int4",
        "RAWINT4 -> kvplugins int4 kernel; weights must be `kvplugins kt convert --method int4` output",
    ),
}
# Names kt-kernel 0.7.2 accepts for inference that kvplugins refuses (their file formats are not read here).
_REFUSED = ("FP8", "FP8_PERCHANNEL", "GPTQ_INT4", "SYCL_GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8", "LLAMAFILE")


def accepted() -> tuple[str, ...]:
    return tuple(_ACCEPTED)


def resolve(name: str, logged: set | None = None) -> Method:
    """Map a kt-kernel method name to our kernel. Raises ConfigError listing the accepted names."""
    key = str(name).upper()
    if key not in _ACCEPTED:
        why = (
            "is a kt-kernel method whose weight format kvplugins does not read"
            if key in _REFUSED
            else "is not a kt-kernel inference method"
        )
        raise ConfigError(
            f"--kt-method {name!r} {why}; kvplugins accepts: {', '.join(_ACCEPTED)} "
            "(convert weights with `kvplugins kt convert --method bf16|int8|int4`)"
        )
    fmt, note = _ACCEPTED[key]
    if logged is None or key not in logged:
        log.info("kt method %s", note)
        if logged is not None:
            logged.add(key)
    return Method(key, fmt, note)
