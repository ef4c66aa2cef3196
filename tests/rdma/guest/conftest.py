"""Tests in this folder need real RDMA devices: they run only inside the soft-RoCE guest (ci/rxe-guest.sh sets
KVPLUGINS_IN_GUEST=1), started by tests/rdma/test_guest.py. On any other host they are not collected at all."""
import os

collect_ignore_glob = [] if os.environ.get("KVPLUGINS_IN_GUEST") == "1" else ["test_*.py"]
