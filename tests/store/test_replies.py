"""The client's typed replies (store/wire/replies.py): a master's get and put_start answers decode into frozen
structs, are the same msgpack arrays on the wire, and a malformed answer (a negative size, no replica, an
offset of 2**63 bytes) is refused naming it instead of reaching a transfer."""

import msgspec
import pytest

from kvplugins.errors import StoreError
from kvplugins.store.wire.replies import Found, Location, found, locations


def test_a_get_answer_decodes_and_is_the_same_array_on_the_wire():
    wire = [4096, [["node-a", 1, 8192], ["node-b", 3, 0]], 5000, 2**64 - 1]
    f = found(wire)
    assert (f.size, f.lease_ttl_ms, f.checksum) == (4096, 5000, 2**64 - 1)
    assert f.replicas == [Location("node-a", 1, 8192), Location("node-b", 3, 0)]
    assert msgspec.msgpack.encode(f) == msgspec.msgpack.encode(wire)
    assert found(f) is f and found([1, [["s", 0, 0]], 0]).checksum is None  # stored without a checksum


@pytest.mark.parametrize(
    "bad",
    [
        [-1, [["s", 0, 0]], 5000],
        [4096, [], 5000],
        [4096, [["s", 0, 2**63]], 5000],
        [4096, [["", 0, 0]], 5000],
        [4096, [["s", 0]], 5000],
        "x",
        None,
    ],
)
def test_a_malformed_get_answer_is_refused_naming_it(bad):
    with pytest.raises(StoreError, match="malformed get answer from the master"):
        found(bad)


def test_a_put_start_grant_decodes_and_a_malformed_one_is_refused():
    assert locations([["node-a", 2, 4096]]) == [Location("node-a", 2, 4096)]
    with pytest.raises(StoreError, match="malformed put_start answer"):
        locations([["node-a", -2, 4096]])
    with pytest.raises(AttributeError):
        Found(1, [Location("s", 0, 0)], 0).size = 2  # frozen
