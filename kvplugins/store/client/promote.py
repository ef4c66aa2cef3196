"""Promote on hit, the client side: a get answer entry ``[ON_DISK, [node endpoint, size]]`` names the node whose
disk holds the object. ``resolve`` asks each such node (its promote endpoint, server.py) to load its objects into
its DRAM segment (verified against their checksum), then asks the master ``get`` again for those keys, so the
caller receives entries in exactly the normal get-answer format. An object that cannot be promoted (file lost
or corrupt, no room, node gone) answers NOT_FOUND: a miss, never wrong bytes.
"""

from __future__ import annotations

import logging
import time

from kvplugins.errors import StoreError
from kvplugins.store.wire import protocol
from kvplugins.store.client.rpc import RawRpcClient

log = logging.getLogger(__name__)
RETRY_S = 0.005  # another client's promotion of the same key is in flight: ask again after this


def resolve(client, keys: list[str], found: list) -> list:
    """``found``: the master's per-key get answer for ``keys``; returns it with every ON_DISK entry replaced by
    the answer after promotion (``[OK, ...]`` or ``[NOT_FOUND, None]``). Waits at most the client's
    rpc_timeout_ms; raises MasterUnreachable if the master stops answering."""
    found = list(found)
    deadline = time.monotonic() + client.cfg.rpc_timeout_ms / 1000
    todo = [i for i, (code, _) in enumerate(found) if code == protocol.ON_DISK]
    while todo:
        codes = _promote(client, [keys[i] for i in todo], [found[i][1] for i in todo])
        for i in todo:
            if codes[keys[i]] not in (protocol.OK, protocol.EXISTS):  # lost, corrupt, no room, node gone
                found[i] = [protocol.NOT_FOUND, None]
        todo = [i for i in todo if found[i][0] == protocol.ON_DISK]
        for i, answer in zip(todo, client.master_call("get", [keys[i] for i in todo]) if todo else []):
            found[i] = answer
        todo = [i for i in todo if found[i][0] == protocol.ON_DISK]
        if todo and time.monotonic() > deadline:
            for i in todo:
                found[i] = [protocol.NOT_FOUND, None]
            break
        if todo:
            time.sleep(RETRY_S)
    return found


def _promote(client, keys: list[str], where: list) -> dict[str, int]:
    """Ask each node to load its keys; key -> the node's result code (NOT_FOUND where the node did not answer)."""
    by_node: dict[str, list[str]] = {}
    for key, (endpoint, _) in zip(keys, where):
        by_node.setdefault(endpoint, []).append(key)
    codes = dict.fromkeys(keys, protocol.NOT_FOUND)
    for endpoint, node_keys in by_node.items():
        rpc = RawRpcClient(endpoint, client.cfg.rpc_timeout_ms, "data")  # a transfer peer of the node
        try:
            for key, (code, _) in zip(node_keys, rpc.call("promote", node_keys)):
                codes[key] = code
        except StoreError as e:
            log.warning("promote of %d keys on %s failed: %s", len(node_keys), endpoint, e)
        finally:
            rpc.close()
    return codes
