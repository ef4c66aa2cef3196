"""The one place a configured master address becomes a client: ``master_client`` (the per-operation raw plane,
what StoreClient uses) and ``control_client`` (the zmq control plane). A plain ``host:port`` gives a direct
client (rpc.py); an HA address (``etcd://host:port[/prefix]`` or a comma list of masters) one that
follows the elected leader (follower.py); a sharded store's (``shards://host:port/prefix``) one routing each
key to its shard (router.py), whose per-shard clients come from here too. Above rpc, follower and router:
nothing below imports it."""

from __future__ import annotations

from kvplugins.store.client.follower import LeaderClient
from kvplugins.store.client.rpc import RawRpcClient, ZmqRpcClient
from kvplugins.store.client.router import ShardedRpc


def _leader_client(address: str, timeout_ms: float, plane: str, role: str):
    """A client following the elected master of an HA address, or None for a single master's host:port."""
    if not (address.startswith("etcd://") or "," in address):
        return None
    return LeaderClient(address, timeout_ms, plane, role)


def master_client(address: str, timeout_ms: float, role: str = "client") -> RawRpcClient:
    """The per-operation client of the master at ``address`` (what StoreClient uses). The one place that turns a
    configured master address into a client. An HA address (``etcd://host:port[/prefix]`` or a comma list of
    masters) gives a client following the elected leader (kvplugins/store/client/follower.py); a sharded store's
    (``shards://host:port/prefix``) one routing each key to its shard (kvplugins/store/client/router.py).
    ``role``: what the connections authenticate as (security/roles.py)."""
    if address.startswith("shards://"):
        return ShardedRpc(address, timeout_ms, role, connect=master_client)
    return _leader_client(address, timeout_ms, "raw", role) or RawRpcClient(address, timeout_ms, role)


def control_client(address: str, timeout_ms: float, role: str = "client") -> ZmqRpcClient:
    """A zmq control-plane client for the master whose raw address is ``address`` (asks ``info``); for an HA
    address, one that follows the leader's control plane. ``role``: what it authenticates as."""
    ha = _leader_client(address, timeout_ms, "zmq", role)
    if ha is not None:
        return ha
    raw = RawRpcClient(address, timeout_ms, role)  # a role credential holds only its own role's key
    try:
        endpoint = raw.call("info")["zmq"]
    finally:
        raw.close()
    return ZmqRpcClient(endpoint, timeout_ms, role)
