"""Request traces: Mooncake's FAST'25 format and our token-block-hash format, one JSON object per line.

FAST'25 (Mooncake's ``mooncake_trace`` files, paper section 4): ``{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [int, ...]}``; each id names one 512-token block, equal ids mean equal
content (and, as ids chain over the prefix, an equal prefix).

Ours, for users who record their own traffic: ``{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "block_hashes": ["<hex>", ...], "session_id": "..."}`` where ``block_hashes`` are the engine's prefix
block hashes (vLLM's or SGLang's page hashes, any string) and ``session_id`` is optional (session routing).
Either format may carry ``session_id``. Requests are replayed in timestamp order (stable for equal times).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvplugins.errors import TraceError


@dataclass(frozen=True)
class Request:
    """One request: arrival ``timestamp_ms`` (ms), ``input_length`` and ``output_length`` (tokens), its prompt's
    ``blocks`` (block ids in order: int or str) and an optional ``session`` id."""

    timestamp_ms: float
    input_length: int
    output_length: int
    blocks: tuple
    session: str | None = None


def load(path: str | Path, limit: int = 0) -> list[Request]:
    """The requests of a trace file, sorted by timestamp; ``limit`` > 0 keeps the first ``limit`` lines' requests.
    Raises TraceError naming the file, line and field for a line that is not JSON, misses a field or holds a
    negative length; ConfigError-derived, so the CLI prints it without a traceback."""
    path = Path(path)
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}; give an existing JSONL file") from e
    out = []
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            out.append(parse(line, f"{path}:{lineno}"))
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def parse(line: str, where: str) -> Request:
    """One trace line; ``where`` ("file:line") prefixes every error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object but {type(obj).__name__}")
    ts = _number(obj, "timestamp", where)
    inp, out = _length(obj, "input_length", where), _length(obj, "output_length", where)
    field = "hash_ids" if "hash_ids" in obj else "block_hashes" if "block_hashes" in obj else None
    if field is None:
        raise TraceError(f"{where}: missing field 'hash_ids' (FAST'25) or 'block_hashes' (kvplugins format)")
    blocks = obj[field]
    if not isinstance(blocks, list) or not all(isinstance(b, (int, str)) and not isinstance(b, bool) for b in blocks):
        raise TraceError(f"{where}: field {field!r} must be a list of block ids (integers or strings)")
    session = obj.get("session_id")
    return Request(ts, inp, out, tuple(blocks), None if session is None else str(session))


def _number(obj: dict, name: str, where: str) -> float:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r} (ms since the trace's start)")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise TraceError(f"{where}: field {name!r} is {v!r}; it must be a number of ms >= 0")
    return float(v)


def _length(obj: dict, name: str, where: str) -> int:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r} (tokens)")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: field {name!r} is {v!r}; it must be an integer number of tokens >= 0")
    return v


def write(path: str | Path, requests: list[Request]) -> None:
    """Write requests in the FAST'25 format (with ``session_id`` where known): what ``--synth`` saves."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            obj = {
                "timestamp": round(r.timestamp_ms, 3),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.blocks),
            }
            if r.session is not None:
                obj["session_id"] = r.session
            f.write(json.dumps(obj) + "\n")
