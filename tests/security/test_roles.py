"""Roles on a real master (issue #30): every op x every role on both of the master's planes is allowed exactly
when the role ranks at or above the op's (security/roles.py), else refused with Forbidden naming the role needed;
a process holding only a client credential cannot connect as node or admin (not with its key, not by claiming
the role), so it cannot drain, register a segment or remove by regex; credentials carry no other role's key."""

import json
import os
import socket

import pytest

from helpers.auth import read_until_closed, use_secret, zmq_endpoint
from helpers.cluster import master_process
from kvplugins.errors import AuthError, Forbidden, StoreError
from kvplugins.security import handshake, load_secret
from kvplugins.security.curve import server_keys
from kvplugins.security.roles import OP_ROLE, RANK
from kvplugins.security.secret import Credential, default_secret, default_secret_path, issue_credential
from kvplugins.store.client.rpc import RawRpcClient, ZmqRpcClient
from kvplugins.store.wire.schema import Schemas

ROLES = ("client", "node", "admin")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A master of its own (the matrix runs remove_all and drain) and a credential file per role, issued from
    the per-user default secret the master uses."""
    d = tmp_path_factory.mktemp("roles")
    secret = load_secret()
    creds = {}
    for role in ROLES:
        creds[role] = d / f"{role}.cred"
        creds[role].write_text(issue_credential(secret, role, f"{role}-test", server_keys(secret)[0]))
        creds[role].chmod(0o600)
    with master_process(d / "m") as m:
        yield m, creds


def test_every_op_has_a_role():
    assert set(OP_ROLE) == set(Schemas(16, 64).types)


@pytest.mark.parametrize("plane", ["raw", "zmq"])
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix(master, monkeypatch, role, plane):
    m, creds = master
    endpoint = zmq_endpoint(m.address) if plane == "zmq" else m.address
    use_secret(monkeypatch, token_file=str(creds[role]))
    rpc = RawRpcClient(m.address, 3000, role) if plane == "raw" else ZmqRpcClient(endpoint, 3000, role)
    try:
        for op, need in sorted(OP_ROLE.items()):
            if RANK[role] < RANK[need]:
                with pytest.raises(
                    Forbidden, match=f"{op} needs the {need} role; this connection authenticated as {role}"
                ):
                    rpc.call(op, [], {})
            else:
                try:
                    rpc.call(op, [], {})  # empty entries: answered, or refused for its fields
                except Forbidden as e:
                    raise AssertionError(f"{role} may run {op}") from e
                except StoreError:
                    pass
    finally:
        rpc.close()


@pytest.mark.parametrize("claimed", ["node", "admin"])
def test_a_client_credential_gives_no_higher_role(master, monkeypatch, tmp_path, claimed):
    m, creds = master
    use_secret(monkeypatch, token_file=str(creds["client"]))
    cred = load_secret()
    assert isinstance(cred, Credential) and cred.role == "client" and cred.key(claimed) is None
    with pytest.raises(Forbidden, match=f"as {claimed} needs the cluster secret or a {claimed} credential"):
        RawRpcClient(m.address, 3000, claimed).call("drain", [])
    with pytest.raises(Forbidden):
        ZmqRpcClient(zmq_endpoint(m.address), 3000, claimed).call("register_segment", [])
    raw = json.loads(creds["client"].read_text())
    secret = default_secret()
    assert raw["key"] == secret.identity_key("client", "client-test").hex() != secret.key("client").hex()
    assert {secret.key(r).hex() for r in ("node", "admin")}.isdisjoint(raw.values())
    endpoint = zmq_endpoint(m.address)
    forged = tmp_path / "forged.cred"  # the client key relabelled: claims the role, cannot prove it
    forged.write_text(json.dumps({**raw, "role": claimed}))
    use_secret(monkeypatch, token_file=str(forged))
    with pytest.raises(AuthError, match="could not prove"):
        RawRpcClient(m.address, 3000, claimed).call("info")
    zmq_forged = ZmqRpcClient(endpoint, 3000, claimed)  # its CURVE key is the client's: it is a client
    try:
        assert zmq_forged.call("status")["segments"] == []
        with pytest.raises(Forbidden, match="authenticated as client"):
            zmq_forged.call("register_segment", [])
    finally:
        zmq_forged.close()


def test_an_unauthenticated_peer_gets_nothing(master):
    m, _ = master
    host, port = m.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\x00\x00\x00\x10" + bytes(16))  # a frame without a handshake
        answer = read_until_closed(s)
    assert answer[:4] == handshake.MAGIC and answer[5] == handshake.REFUSED


def test_another_users_process_is_refused(master, tmp_path):
    """The per-user secret is 0600 in a 0700 folder: another uid cannot read it; a process with another user's
    config folder (so another per-user secret) is refused by the master."""
    import subprocess
    import sys

    m, _ = master
    path = default_secret_path()
    st, folder = path.stat(), path.parent.stat()
    assert (st.st_uid, st.st_mode & 0o777, folder.st_mode & 0o777) == (os.getuid(), 0o600, 0o700)
    if os.getuid() == 0:
        denied = subprocess.run(
            ["cat", str(path)], user=65534, group=65534, capture_output=True, text=True, timeout=30, cwd="/"
        )
        assert denied.returncode != 0 and "Permission denied" in denied.stderr and not denied.stdout
    code = (
        "import sys\nfrom kvplugins.errors import AuthError\nfrom kvplugins.store.client.rpc import "
        f"RawRpcClient\ntry:\n    RawRpcClient({m.address!r}, 3000).call('info')\nexcept AuthError as e:\n"
        "    print('refused:', e)\n    sys.exit(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGINS_AUTH")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "other-user")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "could not prove" in proc.stdout
    assert (tmp_path / "other-user" / "kvplugins" / "secret").stat().st_mode & 0o777 == 0o600
