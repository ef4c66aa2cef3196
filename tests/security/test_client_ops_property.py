"""Issue #30: no sequence of client-role master ops changes another writer's committed bytes other than by removing
that key (hypothesis, against a real master and store node).

Writer W (its own named client credential) stores keys with known bytes through StoreClient. A second process
role, B (another client credential), then sends a generated sequence of raw client-role ops naming W's keys,
its own keys and unknown ones: put_start, put_commit, put_abort, reserve, put (slab), get, exists,
exists_prefix, get_size, remove, remove_checked and report_corrupt, with arbitrary sizes and checksums. After
it W reads every key back: a key B did not remove (remove, remove_checked, or a replica report naming it: a
client may drop what it names, as in Mooncake) holds W's bytes, never other bytes, and is never gone; a key B
removed may be gone or hold whatever B put under that name since. Only master ops are generated: the data plane (transfer writes) is not part of this
property.
"""

import secrets

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.auth import use_secret
from helpers.cluster import store_cluster
from kvplugins.errors import KeyNotFound, StoreError
from kvplugins.security import load_secret
from kvplugins.security.curve import server_keys
from kvplugins.security.secret import issue_credential
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.client.rpc import RawRpcClient

pytestmark = pytest.mark.timeout(600)
W_KEYS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("prop")
    secret, creds = load_secret(), {}
    for name in ("w", "b"):
        creds[name] = d / f"{name}.cred"
        creds[name].write_text(issue_credential(secret, "client", name, server_keys(secret)[0]))
        creds[name].chmod(0o600)
    with store_cluster(nodes=1, segment_size="64MiB", tmp=d / "c") as c:
        yield c, creds


KEY = st.sampled_from([f"w{i}" for i in range(W_KEYS)] + ["b0", "b1", "zz"])
SIZE = st.sampled_from([1, 64, 4096, 1 << 20])
U64 = st.integers(0, (1 << 64) - 1)
OP = st.one_of(
    st.tuples(st.just("put_start"), st.lists(st.tuples(KEY, SIZE), min_size=1, max_size=4), st.just({})),
    st.tuples(st.just("put_commit"), st.lists(KEY, min_size=1, max_size=4), st.just({})),
    st.tuples(st.just("put_abort"), st.lists(KEY, min_size=1, max_size=4), st.just({})),
    st.tuples(st.just("reserve"), st.lists(SIZE, min_size=1, max_size=2), st.just({})),
    st.tuples(
        st.just("put"),
        st.lists(st.tuples(KEY, SIZE, st.integers(0, 64), st.integers(0, 1 << 26)), min_size=1, max_size=3),
        st.just({}),
    ),
    st.tuples(
        st.sampled_from(["get", "exists", "exists_prefix", "get_size"]),
        st.lists(KEY, min_size=1, max_size=4),
        st.just({}),
    ),
    st.tuples(st.just("remove"), st.lists(KEY, min_size=1, max_size=2), st.just({})),
    st.tuples(
        st.just("remove_checked"),
        st.lists(KEY, min_size=1, max_size=2),
        st.fixed_dictionaries({"force": st.booleans()}),
    ),
    st.tuples(
        st.just("report_corrupt"),
        st.lists(st.tuples(KEY, st.text(max_size=20), st.integers(0, 1 << 26), U64), min_size=1, max_size=2),
        st.just({}),
    ),
    # composed from B's own reads: a replica report with the true location and checksum; a put into B's slab
    st.tuples(st.just("report_read"), st.lists(KEY, min_size=1, max_size=2), st.just({})),
    st.tuples(st.just("slab_put"), st.lists(st.tuples(KEY, SIZE), min_size=1, max_size=2), st.just({})),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OP, min_size=1, max_size=12))
def test_client_ops_never_change_another_writers_bytes(cluster, monkeypatch_module, ops):
    c, creds = cluster
    run = secrets.token_hex(4)
    name = {f"w{i}": f"{run}/w{i}" for i in range(W_KEYS)} | {"b0": f"{run}/b0", "b1": f"{run}/b1", "zz": f"{run}/zz"}
    values = {name[f"w{i}"]: secrets.token_bytes(64 + 997 * i) for i in range(W_KEYS)}
    use_secret(monkeypatch_module, token_file=str(creds["w"]))
    with StoreClient(ClientConfig(master=c.master)) as w:
        assert w.batch_put(list(values), list(values.values())) == [None] * W_KEYS
        use_secret(monkeypatch_module, token_file=str(creds["b"]))
        b = RawRpcClient(c.master, 3000, "client")
        removed = set()
        try:
            for op, entries, opts in ops:
                entries = [_named(e, name) for e in entries]
                try:
                    removed |= _send(b, op, entries, opts)
                except StoreError:
                    pass  # refused: fine, nothing applied
        finally:
            b.close()
        for key, data in values.items():
            try:
                got = w.get(key)
            except KeyNotFound:
                assert key in removed, f"{key} vanished though B never removed it; ops {ops}"
                continue
            if key in removed:
                continue  # B removed it and may have put its own object under the name since: any bytes
            assert got == data, f"{key} holds other bytes after {ops}"


def _send(b: RawRpcClient, op: str, entries: list, opts: dict) -> set:
    """Send one generated op as B; returns the keys it may have taken away (remove, or a replica report: a client
    may drop what it names, as in Mooncake)."""
    if op == "report_read":  # B reads the key's location and checksum, then reports it
        gone = set()
        for key in entries:
            [(code, value)] = b.call("get", [key])
            if code == 0 and value[1]:
                seg, _, off = value[1][0]
                b.call("report_corrupt", [[key, seg, off, value[3] or 0]])
                gone.add(key)
        return gone
    if op == "slab_put":  # B puts W's keys into a slab of its own
        [(code, slab)] = b.call("reserve", [1 << 20])
        if code == 0:
            sid, off = slab[0], slab[3]
            b.call("put", [[key, size, sid, off] for key, size in entries], {"xxh3": [1] * len(entries)})
        return set()
    b.call(op, entries, opts)
    if op in ("remove", "remove_checked"):
        return set(entries)
    return {e[0] for e in entries} if op == "report_corrupt" else set()


def _named(entry, name: dict):
    if isinstance(entry, str):
        return name.get(entry, entry)
    if isinstance(entry, tuple) and entry and isinstance(entry[0], str) and entry[0] in name:
        return [name[entry[0]], *entry[1:]]
    return list(entry) if isinstance(entry, tuple) else entry


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
