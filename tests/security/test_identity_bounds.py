"""Per-identity bounds on a real master (issue #30, master/quotas.py): each named credential
(``kvplugins credential --name``) has its own share of pending puts, pending bytes (puts and slabs), segments and
connections. One credential at its bound gets StoreFull (or a refused connection) naming its identity and the
setting, while another credential and the cluster secret go on unaffected; committing, aborting or releasing
gives the room back. A credential whose name was changed cannot prove it."""

import json
import os
import secrets

import pytest

from helpers.auth import use_secret
from helpers.cluster import store_cluster
from kvplugins.errors import AuthError, Forbidden, MasterUnreachable
from kvplugins.security import load_secret
from kvplugins.security.curve import server_keys
from kvplugins.security.secret import issue_credential, owner_proof
from kvplugins.store.wire.protocol import OK, STORE_FULL
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.client.connect import control_client

MiB = 1 << 20
BOUNDS = {
    "max_pending_puts_per_identity": 16,
    "max_pending_share": 0.25,
    "max_segments_per_identity": 2,
    "max_connections_per_identity": 4,
    "admission_probe_ms": 0,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A master with small per-identity bounds, one 64 MiB node (so slabs of 1 MiB exist), and credential files
    client:a, client:b, node:n1, node:n2 issued from the per-user secret the cluster uses."""
    d = tmp_path_factory.mktemp("identity")
    secret, creds = load_secret(), {}
    for role, name in (("client", "a"), ("client", "b"), ("node", "n1"), ("node", "n2")):
        creds[name] = d / f"{name}.cred"
        creds[name].write_text(issue_credential(secret, role, name, server_keys(secret)[0]))
        creds[name].chmod(0o600)
    with store_cluster(nodes=1, segment_size="64MiB", master_flags=BOUNDS, tmp=d / "c") as c:
        yield c, creds


def _raw(c, monkeypatch, cred=None) -> RawRpcClient:
    """A raw RPC client of ``c``'s master holding credential file ``cred`` (None: the cluster secret)."""
    use_secret(monkeypatch, token_file=None if cred is None else str(cred))
    return RawRpcClient(c.master, 3000, "client")


def _keys(prefix: str, n: int, size: int = 4096) -> list:
    return [[f"{prefix}/{secrets.token_hex(4)}/{i}", size] for i in range(n)]


def _codes(answers) -> list:
    return [code for code, _ in answers]


def test_pending_puts_are_bounded_per_credential(cluster, monkeypatch):
    c, creds = cluster
    a, b, admin = _raw(c, monkeypatch, creds["a"]), _raw(c, monkeypatch, creds["b"]), _raw(c, monkeypatch)
    try:
        first = _keys("a", 20)
        answers = a.call("put_start", first)
        assert _codes(answers) == [OK] * 16 + [STORE_FULL] * 4
        assert "credential client:a has 16 puts pending" in answers[-1][1]
        assert "max_pending_puts_per_identity=16" in answers[-1][1]
        b_keys = _keys("b", 16)
        assert _codes(b.call("put_start", b_keys)) == [OK] * 16  # b has a share of its own
        many = _keys("cluster", 40)
        assert _codes(admin.call("put_start", many)) == [OK] * 40  # the cluster secret is not bounded
        assert admin.call("status")["identities"] == {"client:a": [16, 16 * 4096], "client:b": [16, 16 * 4096]}
        assert _codes(a.call("put_commit", [k for k, _ in first[:8]])) == [OK] * 8
        more = _keys("a", 9)
        assert _codes(a.call("put_start", more)) == [OK] * 8 + [STORE_FULL]  # commits gave 8 back
        assert _codes(a.call("put_abort", [k for k, _ in first[8:16] + more[:8]])) == [OK] * 16
        again = _keys("a", 16)
        assert _codes(a.call("put_start", again)) == [OK] * 16  # and aborts
        for rpc, keys in ((a, again + more[8:]), (b, b_keys), (admin, many)):
            rpc.call("put_abort", [k for k, _ in keys])
    finally:
        for rpc in (a, b, admin):
            rpc.close()


def test_pending_bytes_and_slabs_are_bounded_per_credential(cluster, monkeypatch):
    """max_pending_share 0.25 of the 64 MiB pool: 16 MiB of pending puts and reserved slabs per credential."""
    c, creds = cluster
    a, b = _raw(c, monkeypatch, creds["a"]), _raw(c, monkeypatch, creds["b"])
    try:
        big = _keys("a-big", 3, 6 * MiB)
        answers = a.call("put_start", big)
        assert _codes(answers) == [OK, OK, STORE_FULL]
        assert "credential client:a holds" in answers[2][1] and "max_pending_share=0.25" in answers[2][1]
        slabs = b.call("reserve", [MiB] * 20)
        assert _codes(slabs) == [OK] * 16 + [STORE_FULL] * 4  # b's 16 MiB, in slabs
        assert "credential client:b holds 16777216 bytes" in slabs[-1][1]
        ids = [v[0] for code, v in slabs if code == OK]
        again = b.call("reserve", [MiB], {"release": ids[:4]})
        assert _codes(again) == [OK]  # released slabs give room back
        a.call("put_abort", [k for k, _ in big[:2]])
        assert _codes(a.call("put_start", big[2:])) == [OK]
        a.call("put_abort", [big[2][0]])
        b.call("reserve", [], {"release": ids[4:] + [again[0][1][0]]})  # nothing held after: tests run in any order
    finally:
        a.close()
        b.close()


def _bogus(host_id: str, i: int) -> list:
    desc = {
        "v": 1,
        "segment_id": f"bound-{secrets.token_hex(4)}-{i}",
        "host_id": host_id,
        "transports": {"shm": {"pid": os.getpid()}},
        "regions": [[1, 8 * MiB, None]],
    }
    return [desc, 1, 8 * MiB]


def test_segments_are_bounded_per_node_credential(cluster, monkeypatch):
    """Over the zmq control plane (a node's link) each registration names its credential and proves it over the
    owner token (security/secret.py owner_proof); with the probe off the master admits the descriptors."""
    c, creds = cluster
    use_secret(monkeypatch, token_file=str(creds["n1"]))
    n1, n1_keys = control_client(c.master, 3000, "node"), load_secret()
    use_secret(monkeypatch, token_file=str(creds["n2"]))
    n2, n2_keys = control_client(c.master, 3000, "node"), load_secret()
    host = n1.call("describe", [c.nodes[0].address])[0][1]["host_id"]
    owners, names = [], []
    try:
        for i in range(3):
            owners.append(secrets.token_hex(16))
            [answer] = n1.call(
                "register_segment", [_bogus(host, i)], {"owner": owners[-1], **owner_proof(n1_keys, owners[-1])}
            )
            names.append(answer[1])
            assert answer[0] == (OK if i < 2 else STORE_FULL), answer
        assert "credential node:n1 has 2 segments registered" in names[2]
        assert "max_segments_per_identity" in names[2]
        owners.append(secrets.token_hex(16))
        [answer] = n2.call(
            "register_segment", [_bogus(host, 3)], {"owner": owners[-1], **owner_proof(n2_keys, owners[-1])}
        )
        assert answer[0] == OK  # n2 has a share of its own
        names[2] = answer[1]
        with pytest.raises(Forbidden, match="proof of credential node:n2 does not match"):
            n1.call(
                "register_segment",
                [_bogus(host, 4)],
                {"owner": "x", "name": "n2", "proof": owner_proof(n1_keys, "x")["proof"]},
            )
        status = n1.call("status")
        mine = {s["name"]: s["identity"] for s in status["segments"]}
        assert [mine[n] for n in names[:2]] == ["node:n1", "node:n1"] and mine[names[2]] == "node:n2"
    finally:
        for rpc, name, owner in ((n1, names[0], owners[0]), (n1, names[1], owners[1]), (n2, names[2], owners[3])):
            rpc.call("unregister", [name], {"owner": owner})
        n1.close()
        n2.close()


def test_connections_are_bounded_per_credential(cluster, monkeypatch):
    c, creds = cluster
    held = [_raw(c, monkeypatch, creds["a"]) for _ in range(4)]
    try:
        for rpc in held:
            rpc.call("info")
        with pytest.raises(MasterUnreachable, match="credential client:a has 4 connections open"):
            _raw(c, monkeypatch, creds["a"]).call("info")
        b = _raw(c, monkeypatch, creds["b"])
        assert b.call("info")["zmq"]  # another credential connects meanwhile
        b.close()
    finally:
        for rpc in held:
            rpc.close()


def test_a_renamed_credential_cannot_prove_its_name(cluster, monkeypatch, tmp_path):
    c, creds = cluster
    forged = tmp_path / "forged.cred"
    forged.write_text(json.dumps({**json.loads(creds["a"].read_text()), "name": "b"}))
    forged.chmod(0o600)
    with pytest.raises(AuthError, match="could not prove"):
        _raw(c, monkeypatch, forged).call("info")


def test_a_store_node_with_a_node_credential_registers_under_its_name(cluster, tmp_path):
    """``kvplugins store --token-file node.cred``: its raw probe and control link authenticate as node (a role
    credential holds no client key), and its segment counts to node:n1."""
    _, creds = cluster
    with store_cluster(nodes=0, tmp=tmp_path) as c:
        node = c.add_node("8MiB", token_file=str(creds["n1"]))
        segs = control_client(c.master, 3000).call("status")["segments"]
        assert [(s["name"], s["identity"]) for s in segs] == [(node.address, "node:n1")]
