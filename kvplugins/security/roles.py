"""Roles: what each authenticated connection to the master may do (issue #30).

A connection's role is fixed by its handshake (handshake.py, curve.py): the key it proved is one role's key.
Roles are ranked, each with the rights of those below it:

* ``client``  put / get / exists / remove (a key it names) / status / describe, the ops an engine needs;
* ``node``    also register, heartbeat and unregister segments, report its disk tier and tier work;
* ``admin``   also drain a segment, remove by regex, remove all, create replica tasks.

``data`` is the role of a transfer peer (page bytes between clients and nodes, security/handshake.py); it has no
master rights. Which role a process claims: StoreClient ``client`` (its segment's link ``node``), store nodes
``node``, ``kvplugins store --drain`` and the compat layer's admin ops ``admin``. The cluster secret gives every
role; a role credential (``kvplugins credential``) only its own. Mooncake has no roles (any client may mount,
unmount and remove anything); Redis ACL categories and Ceph capabilities are the anchors.
"""

from __future__ import annotations

ROLES = ("data", "client", "node", "admin")
MASTER_ROLES = ROLES[1:]  # the roles a master serves and a credential can give
RANK = {role: rank for rank, role in enumerate(ROLES)}
FORBIDDEN = "forbidden: "  # prefix of a master's refusal for an op outside the connection's role

_CLIENT = (
    "info",
    "status",
    "put_start",
    "put_commit",
    "put_abort",
    "reserve",
    "put",
    "get",
    "exists",
    "exists_prefix",
    "remove",
    "get_size",
    "remove_checked",
    "report_corrupt",
    "describe",
    "task_query",
)
_NODE = (
    "register_segment",
    "heartbeat",
    "unregister",
    "tier_register",
    "tier_poll",
    "tier_done",
    "promote_start",
    "promote_commit",
)
_ADMIN = ("drain", "remove_by_regex", "remove_all", "task_create")
OP_ROLE = {**dict.fromkeys(_CLIENT, "client"), **dict.fromkeys(_NODE, "node"), **dict.fromkeys(_ADMIN, "admin")}


def needed(op: str) -> str:
    """The lowest role that may run ``op`` (an op not listed here needs admin)."""
    return OP_ROLE.get(op, "admin")


def refusal(op: str, role: str) -> str | None:
    """None when ``role`` may run ``op``, else the refusal text (prefixed FORBIDDEN) naming the role needed."""
    need = needed(op)
    if RANK.get(role, -1) >= RANK[need]:
        return None
    return (
        f"{FORBIDDEN}{op} needs the {need} role; this connection authenticated as {role} (give the process the "
        f"cluster secret or a {need} credential: kvplugins credential --role {need} --out FILE)"
    )
