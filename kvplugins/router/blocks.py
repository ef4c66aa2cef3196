"""What the engines' caches and the shared pool hold, in the router's block ids, from KV events.

The router names a prompt's blocks by ``block_ids`` (fleet.py): chained xxh3 of each block's tokens. An engine
names them by its own hash (vLLM: sha256 over the parent hash, tokens and extras, seeded per deployment; SGLang:
its own), which the router cannot recompute. A ``BlockStored`` event carries both sides: the blocks' hashes,
their tokens and the parent block's hash, so ``BlockNames.learn`` computes the router's ids from the tokens,
chained on the parent's id, and remembers the pairing; a later ``BlockRemoved`` (hashes only) and the pool's
events (object keys ``<namespace>/<hash hex>``: layout/keys.py) are understood through it. Engine hashes are
compared as ``canonical`` ints (the last 8 bytes, big-endian, as vLLM's ``maybe_convert_block_hash`` makes its
int hashes), so bytes and int streams of one engine agree.

Where the engines are vLLM, the router can also compute their block hashes itself (``EngineHasher``, with vLLM's
own functions, ``--engine-hash vllm:sha256``): then a prompt's blocks are named as the engines and the pool name
them even when no engine the router listens to has announced them (a pool filled before the router started, or by
instances it does not front).

Nothing here is trusted beyond a hint: a lost or lying event can only make a prediction wrong, never a request
fail (the instance computes what it lacks). Both maps are bounded (LRU).
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

MASK64 = (1 << 64) - 1


def chain(prev: int, tokens: list[int]) -> int:
    """The router's id of a block of ``tokens`` after the block whose id is ``prev`` (0: the first block)."""
    return xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens))


def canonical(h: bytes | int) -> int:
    """An engine block hash as a 64-bit int: bytes by their last 8 (big-endian), ints modulo 2**64."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h[-8:]), "big")
    return int(h) & MASK64


def key_hash(key: bytes) -> int | None:
    """The canonical engine hash a store key ``<namespace>/<hex>`` names; None for a key of another shape."""
    _, sep, tail = key.rpartition(b"/")
    try:
        return canonical(bytes.fromhex(tail.decode())) if sep and tail else None
    except (UnicodeDecodeError, ValueError):
        return None


class BlockNames:
    """engine hash <-> router block id, for the last ``capacity`` blocks learned."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._rid: OrderedDict[int, int] = OrderedDict()  # canonical engine hash -> router id
        self._hash: dict[int, int] = {}  # router id -> canonical engine hash
        self.unchained = 0  # stored events whose parent block was not known (their blocks are not learned)

    def __len__(self) -> int:
        return len(self._rid)

    def learn(
        self, parent: bytes | int | None, hashes: list[bytes | int], tokens: list[int], block_tokens: int
    ) -> list[int]:
        """The router ids of the blocks of one BlockStored event (``len(tokens) == len(hashes) * block_tokens``,
        else nothing), learned; [] when the parent block is unknown."""
        if len(tokens) != len(hashes) * block_tokens or not hashes:
            return []
        prev = 0
        if parent is not None:
            known = self._rid.get(canonical(parent))
            if known is None:
                self.unchained += 1
                return []
            prev = known
        out = []
        for i, h in enumerate(hashes):
            prev = chain(prev, tokens[i * block_tokens : (i + 1) * block_tokens])
            self._put(canonical(h), prev)
            out.append(prev)
        return out

    def _put(self, h: int, rid: int) -> None:
        self._rid[h] = rid
        self._rid.move_to_end(h)
        self._hash[rid] = h
        while len(self._rid) > self.capacity:
            old, old_rid = self._rid.popitem(last=False)
            if self._hash.get(old_rid) == old:
                del self._hash[old_rid]

    def teach(self, rids: list[int], hashes: list[int]) -> None:
        """Pair the router ids of a prompt's blocks with their canonical engine hashes (EngineHasher)."""
        for rid, h in zip(rids, hashes):
            if self._hash.get(rid) != h:
                self._put(h, rid)

    def rid(self, h: bytes | int) -> int | None:
        return self._rid.get(canonical(h))

    def engine_hash(self, rid: int) -> int | None:
        return self._hash.get(rid)


class EngineHasher:
    """vLLM's own prefix-cache block hashes of a prompt, canonical (``algo``: vLLM's ``--prefix-caching-hash-algo``,
    e.g. ``sha256``, its default). Uses vLLM's functions (vllm.v1.core.kv_cache_utils.hash_block_tokens, the seed
    from ``init_none_hash``: fixed for sha256 unless PYTHONHASHSEED is set, which must then match the engines').
    Blocks with extra keys (LoRA, multimodal inputs, cache_salt) hash differently in vLLM: the router leaves such
    requests to the engines' events. Raises ConfigError when vLLM is not importable or ``algo`` unknown."""

    def __init__(self, algo: str):
        from kvplugins.errors import ConfigError

        try:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core import kv_cache_utils
        except ImportError as e:
            raise ConfigError(f"router --engine-hash vllm:{algo} needs vLLM importable beside the router ({e})") from e
        try:
            self._fn = get_hash_fn_by_name(algo)
        except ValueError as e:
            raise ConfigError(f"router --engine-hash vllm:{algo}: {e}") from e
        kv_cache_utils.init_none_hash(self._fn)
        self._block = kv_cache_utils.hash_block_tokens

    def hashes(self, tokens: list[int], block_tokens: int) -> list[int]:
        """The canonical hashes of the full blocks of ``tokens``."""
        out, parent = [], None
        for i in range(len(tokens) // block_tokens):
            parent = self._block(self._fn, parent, tokens[i * block_tokens : (i + 1) * block_tokens])
            out.append(canonical(parent))
        return out


class Pool:
    """The blocks the shared pool holds, by canonical engine hash: a count of the store objects naming each (one
    per TP rank, KV head or layer group), so a block counts while one of them is left. ``exact`` once the
    master's own stream feeds it (removals known); otherwise the engines' connector events feed it, which
    announce saves only, and the oldest ``capacity`` blocks are forgotten."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._count: OrderedDict[int, int] = OrderedDict()
        self.exact = False

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, h: int) -> bool:
        return h in self._count

    def add(self, h: int) -> None:
        """One more store object names ``h`` (the master's stream)."""
        self._put(h, self._count.get(h, 0) + 1)

    def seen(self, h: int) -> None:
        """A connector announced ``h`` saved (ignored once the master's stream is exact)."""
        if not self.exact:
            self._put(h, 1)

    def _put(self, h: int, count: int) -> None:
        self._count[h] = count
        self._count.move_to_end(h)
        while len(self._count) > self.capacity:
            self._count.popitem(last=False)

    def remove(self, h: int) -> None:
        left = self._count.get(h, 0) - 1
        if left > 0:
            self._count[h] = left
        else:
            self._count.pop(h, None)

    def prefix(self, names: BlockNames, blocks: list[int], start: int) -> int:
        """How many consecutive blocks from ``blocks[start]`` the pool holds."""
        n = start
        while n < len(blocks):
            h = names.engine_hash(blocks[n])
            if h is None or h not in self._count:
                break
            n += 1
        return n - start
