"""The one exception hierarchy of kvplugins. Every error a public API raises derives from KVPluginsError.

KVPluginsError
├── ConfigError            bad flag / env / file value; the message names the value and the fix
│   └── TraceError         a malformed request trace (kvplugins/replay): names the file, line and field
├── NativeError            a native status code (kvplugins/native.py converts them, in one place)
├── AuthError              a peer refused our shared secret, or could not prove it holds it (kvplugins/security)
│   └── Forbidden          an op outside the role this connection authenticated as (names the role needed)
├── TransferError          the transfer core (kvplugins/transfer)
│   ├── ProtocolError      malformed or unknown-version frame on the wire
│   ├── OutOfRange         a request outside a registered region
│   └── TransferFailed     the bytes did not move (peer gone, timeout, every transport failed)
│       ├── LeaseExpired   a store read ended after its read lease: its bytes may be stale, so they are not used
│       └── SlotsBusy      no staging bounce slot freed in time (this process is busy; no peer failed)
└── StoreError             the store (kvplugins/store)
    ├── KeyNotFound
    │   └── ChecksumMismatch   every replica read failed its checksum (a miss; never wrong bytes)
    ├── StoreFull          no space even after evicting every evictable object
    ├── PutPending         another writer's put of the key has not committed (retryable; never "stored")
    ├── BufferNotRegistered
    ├── SizeMismatch
    └── MasterUnreachable  names the address and the timeout
"""

from __future__ import annotations


class KVPluginsError(Exception):
    """Base of every kvplugins error."""


class ConfigError(KVPluginsError, ValueError):
    """A configuration value is invalid. The message names the value and how to fix it."""


class TraceError(ConfigError):
    """A request trace line is malformed: the message names the file, the line number and the field."""


class NativeError(KVPluginsError):
    """The native core returned a failure status."""


class AuthError(KVPluginsError):
    """Authentication with a peer failed: it refused this process's shared secret (none, or a different one),
    or it could not prove that it holds ours. The message names the peer and the fix."""


class Forbidden(AuthError):
    """The op needs a role this process's credential does not give (client < node < admin): a client credential
    cannot drain, register segments or remove by regex. The message names the op and the role it needs."""


class TransferError(KVPluginsError):
    """Base of transfer-core errors."""


class ProtocolError(TransferError):
    """A frame on the wire is malformed, too large, or of an unknown version."""


class OutOfRange(TransferError, IndexError):
    """A transfer entry falls outside its registered region."""


class TransferFailed(TransferError):
    """A transfer did not complete: the peer is gone, timed out, or every transport failed."""


class LeaseExpired(TransferFailed):
    """A store read ended after the read lease its lookup granted (lease_ttl_ms): the object's space may have
    been handed to another object meanwhile, so the bytes are not used. The store client reads such entries
    again under a new lease (store_client.LEASE_ROUNDS rounds) before it returns this."""


class SlotsBusy(TransferFailed):
    """No staging bounce slot (transfer/staging.py) freed within its timeout: every slot is held by this
    process's own transfers still running. Not sent; no peer failed (a miss or "not saved", not an outage)."""


class StoreError(KVPluginsError):
    """Base of store errors."""


class KeyNotFound(StoreError, KeyError):
    """The key is not stored (never put, removed, evicted, or its node died)."""

    def __str__(self) -> str:  # KeyError quotes its arg; keep the message readable
        return str(self.args[0]) if self.args else "key not found"


class ChecksumMismatch(KeyNotFound):
    """The object's bytes did not match its xxh3_64 checksum on any replica: reported as a miss."""


class StoreFull(StoreError):
    """No segment can hold the object even after evicting every evictable object."""


class PutPending(StoreError):
    """Another writer's put of this key started but has not committed within the client's ``pending_wait_ms``:
    nothing was stored by this put. Retry later; the other put commits, aborts, or is reclaimed after the
    master's ``put_timeout_ms``."""


class BufferNotRegistered(StoreError):
    """A zero-copy call named memory that was never registered with the transfer engine."""


class SizeMismatch(StoreError):
    """The destination buffer size differs from the stored object's size."""


class MasterUnreachable(StoreError):
    """The master did not answer within the timeout. The message names the address and the timeout."""

    def __init__(self, address: str, timeout_ms: float, detail: str = ""):
        self.address, self.timeout_ms = address, timeout_ms
        msg = f"master {address} did not answer within {timeout_ms:g} ms"
        super().__init__(
            msg
            + (f": {detail}" if detail else "")
            + "; check that `kvplugins master` (or `kvplugins up`) runs there, or raise the timeout"
        )
