"""Master high availability on etcd (issue #6): several ``kvplugins master --etcd URL`` processes, one leader.

* election.py  — Elector: a leader key held under an etcd lease (campaign = create-if-absent transaction)
* journal.py   — EtcdJournal: the master's Journal hooks persisted in etcd (fenced on the leader key); load()
* recovery.py  — rebuild a MasterService's segments, allocators and object table from the journal
* leader.py    — LeaderGuard: what RpcServer serves; the leader's MasterService, or "not leader" answers
  (wire/protocol.py NOT_LEADER)
* group_commit.py — RpcServer holds a loop turn's replies until that turn's etcd writes are persisted
* master.py    — ``kvplugins master --etcd``: wires the above around RpcServer

The etcd client is store/cluster/etcd.py; the clients' side (following the leader) store/client/follower.py.
Nothing here is imported by ``import kvplugins``; etcd3gw is imported only when an etcd address is used.
"""
