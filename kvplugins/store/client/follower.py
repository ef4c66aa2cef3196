"""LeaderClient: a master client that finds the elected master and follows it across fail-overs.

Addresses: ``etcd://host:port[,host:port][/prefix]`` (the leader's addresses are read from ``{prefix}/leader``;
default prefix /kvplugins/default) or a comma list ``host:port,host:port`` of masters (the one answering ``info``
leads; standbys refuse). Same interface as RawRpcClient (call / send_deferred / flush / close, ``address``,
``timeout_ms``). An op that fails because the master is gone or answers "not leader" is retried on the
(re-resolved) leader until the op's timeout; then MasterUnreachable names the address and the timeout.
Retrying is safe for the store's ops: puts are idempotent by key (a put_start the dead leader had not journaled
is simply allocated again; its put_commit on the new leader answers "expired", so the put is not acknowledged);
put_start is not re-sent to a still-living leader whose connection failed after it was sent (ONCE_PER_LEADER);
a put_commit re-sent to a leader that had applied it answers OK, matched by the object's checksum.
"""

from __future__ import annotations

import threading
import time

from kvplugins.errors import AuthError, MasterUnreachable, StoreError
from kvplugins.store.client.rpc import RawRpcClient, ZmqRpcClient
from kvplugins.store.cluster.etcd import Etcd, parse_endpoint
from kvplugins.store.wire.protocol import NOT_LEADER

BACKOFF_S = 0.05
DEFAULT_PREFIX = "/kvplugins/default"
# Ops not re-sent to a leader that may have applied them before the connection failed (a second put_start of a
# key would answer "exists (pending)" and the put would look done; a second reserve would hold a slab nobody
# fills until it expires); on a new leader they are safe to re-send.
ONCE_PER_LEADER = frozenset({"put_start", "reserve"})


class _EtcdFinder:
    def __init__(self, address: str, timeout_ms: float, role: str = "client"):  # (etcd: no master role)
        endpoints, prefix = parse_endpoint(address)
        self.etcd = Etcd(",".join(f"http://{h}:{p}" for h, p in endpoints), timeout_s=min(2.0, timeout_ms / 1000))
        self.key = (prefix or DEFAULT_PREFIX) + "/leader"

    def leader(self, deadline: float) -> dict | None:
        return self.etcd.get_json(self.key, deadline)

    def none_found(self) -> str:
        return f"no leader is elected: etcd {self.etcd.url} has no {self.key} (masters down, or another prefix?)"


class _ListFinder:
    def __init__(self, address: str, timeout_ms: float, role: str = "client"):
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        self.role = role  # a role credential authenticates only as its own role

    def leader(self, deadline: float) -> dict | None:
        for addr in self.addresses:
            probe = RawRpcClient(addr, max(50.0, min(1000.0, (deadline - time.monotonic()) * 1000)), self.role)
            try:
                return {"raw": addr, "zmq": probe.call("info")["zmq"]}
            except StoreError:
                continue
            finally:
                probe.close()
        return None

    def none_found(self) -> str:
        return f"none of the masters {', '.join(self.addresses)} answered as leader"


class LeaderClient:
    """Follow the leader of ``address``; ``plane``: "raw" (per-operation endpoint) or "zmq" (control plane)."""

    def __init__(self, address: str, timeout_ms: float, plane: str = "raw", role: str = "client"):
        self.address, self.timeout_ms, self.plane, self.role = address, timeout_ms, plane, role
        self._finder = (_EtcdFinder if address.startswith("etcd://") else _ListFinder)(address, timeout_ms, role)
        self._inner, self._leader_id = None, None
        self._lock = threading.RLock()

    def call(self, op: str, entries=(), opts: dict | None = None, timeout_ms: float | None = None):
        """Run ``op`` on the leader; returns its payload. Raises MasterUnreachable (no leader answered in
        time), StoreError (the leader refused the request)."""
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        return self._retry(op, timeout, lambda inner, left_ms: inner.call(op, entries, opts, timeout_ms=left_ms))

    def send_deferred(self, op: str, entries=(), opts: dict | None = None, on_reply=None) -> None:
        """RawRpcClient.send_deferred on the leader (re-sent to a new leader if it cannot be sent)."""
        self._retry(op, self.timeout_ms, lambda inner, _: inner.send_deferred(op, entries, opts, on_reply))

    def flush(self, timeout_ms: float | None = None) -> None:
        """Read the replies of the deferred requests (see RawRpcClient.flush). Raises MasterUnreachable."""
        with self._lock:
            if self._inner is not None and hasattr(self._inner, "flush"):
                self._inner.flush(timeout_ms)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def held(self, op: str, timeout_ms: float | None = None) -> "LeaderHeld":
        """The leader's connection for one native exchange of ``op`` (RawRpcClient.held), as a context manager;
        raw plane only. Entering finds the leader (raises MasterUnreachable when none answers in time); a failed
        exchange or a "not leader" answer drops it, and the caller goes on through ``call``, which retries on
        the next leader (store_client.py)."""
        if self.plane != "raw":
            raise MasterUnreachable(self.address, 0, f"{op}: native exchanges need the raw plane")
        return LeaderHeld(self, op, self.timeout_ms if timeout_ms is None else timeout_ms)

    def _retry(self, op: str, timeout_ms: float, fn):
        deadline = time.monotonic() + timeout_ms / 1000
        last: Exception | None = StoreError(self._finder.none_found())
        applied_by = None  # leader that may have applied ``op`` before its connection failed
        with self._lock:
            while True:
                try:
                    inner = self._connect(deadline)
                except StoreError as e:
                    inner, last = None, self._failed(e)
                if inner is not None:
                    if self._leader_id == applied_by:
                        raise MasterUnreachable(
                            self.address,
                            timeout_ms,
                            f"{op}: the connection to leader {self._leader_id} failed after sending; not sent again",
                        ) from last
                    try:
                        return fn(inner, self._attempt_ms(deadline))
                    except StoreError as e:
                        if isinstance(e, MasterUnreachable) and op in ONCE_PER_LEADER:
                            applied_by = self._leader_id
                        last = self._failed(e)
                    except AuthError as e:
                        if self.plane != "zmq":
                            raise
                        last = self._curve_failed(op, e)
                if time.monotonic() + BACKOFF_S >= deadline:
                    raise MasterUnreachable(self.address, timeout_ms, f"{op}: no leader answered: {last}") from last
                time.sleep(BACKOFF_S)

    def _failed(self, err: StoreError) -> StoreError:
        """Forget the current leader after ``err`` (it is gone or not leader); re-raise any other refusal."""
        if not isinstance(err, MasterUnreachable) and NOT_LEADER not in str(err):
            raise err
        self._drop()
        return err

    def _curve_failed(self, op: str, err: AuthError) -> StoreError:
        """A CURVE handshake with the leader's control plane failed. zmq reports a peer that dies mid-handshake
        (a leader killed) like a refusal, and this process passed the leader's raw-plane handshake with the same
        secret, so: drop the leader and look it up again; the lookup's probe raises AuthError if the secret is
        really wrong."""
        self._drop()
        return MasterUnreachable(self.address, self.timeout_ms, f"{op}: {err}")

    def _attempt_ms(self, deadline: float) -> float:
        """Time for one attempt: all that is left on the raw plane (a dead peer's TCP connection fails at
        once); half of it on zmq, whose requests to a dead endpoint just wait, so a re-lookup still fits."""
        left = max(1.0, (deadline - time.monotonic()) * 1000)
        return left if self.plane == "raw" else max(min(left, 200.0), left / 2)

    def _connect(self, deadline: float):
        if self._inner is None:
            try:
                leader = self._finder.leader(deadline)
            except StoreError as e:
                raise MasterUnreachable(self.address, self.timeout_ms, f"leader lookup: {e}") from e
            if leader is None:
                return None
            self._inner = (
                RawRpcClient(leader["raw"], self.timeout_ms, self.role)
                if self.plane == "raw"
                else ZmqRpcClient(leader["zmq"], self.timeout_ms, self.role)
            )
            self._leader_id = leader.get("id", leader["raw"])
            self._probe(leader["raw"], deadline)
        return self._inner

    def _probe(self, raw: str, deadline: float) -> None:
        """Ask ``info`` on the leader's raw endpoint: it is up and it leads. On the zmq plane this is a separate
        TCP probe, because a zmq request to a dead endpoint only times out, while a TCP connect is refused."""
        probe = self._inner if self.plane == "raw" else RawRpcClient(raw, self.timeout_ms, self.role)
        try:
            probe.call("info", timeout_ms=max(1.0, (deadline - time.monotonic()) * 1000))
        finally:
            if probe is not self._inner:
                probe.close()

    def _drop(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None


class LeaderHeld:
    """LeaderClient.held: the current leader's RawRpcClient.held, with LeaderClient's lock held around it; ``fd``,
    ``rid``, ``ms``, ``payload`` and ``failed`` as Held's, except that a failure or a "not leader" refusal also
    forgets the leader (on exit: its connection's lock is held until then), raised as MasterUnreachable."""

    def __init__(self, client: LeaderClient, op: str, timeout_ms: float):
        self.client, self.op, self.timeout_ms = client, op, timeout_ms
        self._held = None
        self._forget = False

    def __enter__(self) -> "LeaderHeld":
        c = self.client
        c._lock.acquire()
        try:
            deadline = time.monotonic() + self.timeout_ms / 1000
            inner = c._connect(deadline)
            if inner is None:
                raise MasterUnreachable(c.address, self.timeout_ms, f"{self.op}: {c._finder.none_found()}")
            self._held = inner.held(self.op, max(1.0, (deadline - time.monotonic()) * 1000)).__enter__()
        except StoreError as e:  # no leader now, or the one found refused the probe
            c._drop()
            c._lock.release()
            raise e if isinstance(e, MasterUnreachable) else MasterUnreachable(c.address, self.timeout_ms, str(e))
        except BaseException:
            c._lock.release()
            raise
        self.fd, self.rid, self.ms = self._held.fd, self._held.rid, self._held.ms
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._held.__exit__(*exc)
            if self._forget:
                self.client._drop()
        finally:
            self.client._lock.release()

    def payload(self, body: bytes):
        try:
            return self._held.payload(body)
        except MasterUnreachable:
            self._forget = True
            raise
        except StoreError as e:
            if NOT_LEADER not in str(e):
                raise
            self._forget = True
            raise MasterUnreachable(self.client.address, self.timeout_ms, f"{self.op}: {e}") from e

    def failed(self, err: Exception) -> MasterUnreachable:
        self._forget = True
        return self._held.failed(err)


def leader_info(address: str, timeout_ms: float = 2000) -> dict | None:
    """{"raw", "zmq", ...} of the current leader of ``address`` (etcd:// or a comma list), or None."""
    finder = (_EtcdFinder if address.startswith("etcd://") else _ListFinder)(address, timeout_ms)
    return finder.leader(time.monotonic() + timeout_ms / 1000)
