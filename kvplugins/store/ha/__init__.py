"""Master high availability on etcd (issue #6): several ``kvplugins master --etcd URL`` processes, one leader.

* etcd.py      — the etcd v3 client (etcd3gw over etcd's HTTP/JSON gateway), key layout, fenced transactions
* election.py  — Elector: a leader key held under an etcd lease (campaign = create-if-absent transaction)
* journal.py   — EtcdJournal: the master's Journal hooks persisted in etcd (fenced on the leader key); load()
* recovery.py  — rebuild a MasterService's segments, allocators and object table from the journal
* leader.py    — LeaderGuard: what RpcServer serves; the leader's MasterService, or "not leader" answers
* group_commit.py — RpcServer holds a loop turn's replies until that turn's etcd writes are persisted
* follower.py  — LeaderClient: a master client that finds the leader (etcd:// or a comma list) and follows it
* master.py    — ``kvplugins master --etcd``: wires the above around RpcServer

Nothing here is imported by ``import kvplugins``; etcd3gw is imported only when an etcd address is used.
"""

NOT_LEADER = "not leader"      # how a standby's refusals start (clients re-resolve the leader on it)
