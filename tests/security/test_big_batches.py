"""A big batch keeps no other client waiting (issue #30 items 3 and 5), on a real master: another process sends a
65,536-key put_start, put_commit, get (column answer), exists and remove, each run in slices (master/batches.py),
and checks that every answer is the whole batch's, in order; meanwhile this process's exists each answer in
< 250 ms. (The big client is its own process so that its encoding and decoding do not hold this one's GIL.)"""

import subprocess
import sys
import time

from helpers.cluster import store_cluster
from kvplugins.store.client.rpc import RawRpcClient

BIG_CLIENT = """
import sys
from kvplugins.store.wire.protocol import OK
from kvplugins.store.client.rpc import RawRpcClient
N = 65_536
keys = [f"big/{i:08d}" for i in range(N)]
big = RawRpcClient(sys.argv[1], 60000)
out = big.call("put_start", [[k, 64] for k in keys])
assert len(out) == N and all(code == OK for code, _ in out)
assert big.call("put_commit", keys, {"xxh3": list(range(N))}) == [[OK, None]] * N
ttl, sizes, names, regions, idx, offs, more, sums, disk = big.call("get", keys, {"cols": 1})
assert sizes == [64] * N and sums == list(range(N)) and len(names) == 1 and set(idx) == {0}
assert len(set(offs)) == N and more == {} and disk == {}
assert big.call("exists", keys) == [True] * N
assert big.call("remove", keys) == [[OK, None]] * N
print("big batches ok")
"""


def test_a_65536_key_batch_keeps_no_other_client_waiting(tmp_path):
    with store_cluster(nodes=1, segment_size="64MiB", tmp=tmp_path) as c:
        other = RawRpcClient(c.master, 3000)
        try:
            other.call("exists", ["big/00000001"])  # connected and authenticated before timing
            proc = subprocess.Popen(
                [sys.executable, "-c", BIG_CLIENT, c.master],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            waits = []
            while proc.poll() is None:
                t0 = time.perf_counter()
                other.call("exists", ["big/00000001"])
                waits.append(time.perf_counter() - t0)
            output = proc.communicate(timeout=60)[0]
            assert proc.returncode == 0 and "big batches ok" in output, output
            # an op run unsliced holds everyone for seconds; decoding the big request's one frame is not sliced and
            # took up to 120 ms on CI's 2 loaded cores (one wait of 7,008)
            assert len(waits) >= 20 and max(waits) < 0.25, (len(waits), sorted(waits)[-5:])
            assert other.call("status")["objects"] == 0
        finally:
            other.close()
