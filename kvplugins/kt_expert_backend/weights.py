"""The converted expert-weight format that ``kvplugins kt convert`` writes and ``KTMoEWrapper.load_weights`` reads.

    DIR/kvplugins-kt.json          {"version": 1, "format": "bf16|int8|int4", "group": 128, "num_experts": E,
                                    "hidden_size": H, "moe_intermediate_size": I, "layers": [..]}
    DIR/layer-0003.safetensors     per expert e and projection p in gate, up, down:
                                    "{e}.{p}.q" (bf16: uint16 bits [N, K]; int8: int8 [N, K]; int4: uint8 [N, K/2])
                                    "{e}.{p}.scale" float32 (int8: [N, 1]; int4: [N, K/group]; bf16: absent)

gate/up are [I, H], down is [H, I] (rows = output channels), as native.quantize() returns them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvplugins.errors import ConfigError

META = "kvplugins-kt.json"
PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class Meta:
    format: str
    group: int
    num_experts: int
    hidden_size: int
    moe_intermediate_size: int
    layers: list = field(default_factory=list)
    version: int = 1


def layer_file(root, layer: int) -> Path:
    return Path(root) / f"layer-{layer:04d}.safetensors"


def read_meta(root) -> Meta:
    p = Path(root) / META
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--kt-weight-path {str(root)!r} has no {META}: it is not `kvplugins kt convert` output; "
            f"run `kvplugins kt convert --input HF_DIR --output {root} --method int8`"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p} cannot be read: {e}") from e
    if d.get("version") != 1:
        raise ConfigError(f"{p} has version {d.get('version')!r}; this kvplugins reads version 1 (re-run convert)")
    return Meta(**d)


def write_meta(root, meta: Meta) -> None:
    tmp = Path(root) / (META + ".tmp")
    tmp.write_text(json.dumps(asdict(meta), indent=1))
    os.replace(tmp, Path(root) / META)


def save_layer(root, layer: int, tensors: dict) -> None:
    """tensors: name -> numpy array; written atomically (tmp + rename)."""
    from safetensors.numpy import save_file

    final = layer_file(root, layer)
    tmp = final.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, final)


class LayerReader:
    """Reads one converted layer's tensors (memory-mapped by safetensors)."""

    def __init__(self, root, layer: int):
        from safetensors import safe_open

        path = layer_file(root, layer)
        if not path.exists():
            raise ConfigError(f"{path} is missing: layer {layer} was not converted into {root}")
        self._f = safe_open(str(path), framework="np")
        self._keys = set(self._f.keys())

    def get(self, expert: int, proj: str):
        """(q, scale or None) of one projection; raises ConfigError if the expert is absent."""
        key = f"{expert}.{proj}.q"
        if key not in self._keys:
            raise ConfigError(f"converted layer lacks {key}; re-run `kvplugins kt convert`")
        scale = self._f.get_tensor(f"{expert}.{proj}.scale") if f"{expert}.{proj}.scale" in self._keys else None
        return self._f.get_tensor(key), scale
