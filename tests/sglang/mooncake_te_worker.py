"""One side of SGLang's Mooncake P/D transfer (``MooncakeTransferEngine``, srt/distributed/device_communicators/
mooncake_transfer_engine.py) running on kvplugins through the ``mooncake.engine`` shim (site dir: argv[2]).

    python mooncake_te_worker.py decode SITE   registers a zeroed KV-like tensor, prints its session id, address
                                               and size, then on "check <hex digest>" answers whether its bytes hash so
    python mooncake_te_worker.py prefill SITE SESSION ADDR
                                               registers a filled tensor and writes it into decode's in 4 page spans
                                               (SGLang's batch_transfer_sync); prints the return code and digest

SGLang imports triton at module level: sglang_cpu stands it in (as in the rest of tests/sglang)."""

from __future__ import annotations

import hashlib
import json
import site
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
site.addsitedir(sys.argv[2])
import sglang_cpu  # noqa: E402

sglang_cpu.install()
import torch  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine  # noqa: E402

PAGES, PAGE_ELEMS = 4, 16 * 8 * 64  # 4 pages of [16 tokens, 8 heads, 64 dims] float16


def main() -> None:
    role = sys.argv[1]
    engine = MooncakeTransferEngine("127.0.0.1")
    assert type(engine.engine).__module__ == "kvplugins.mooncake.te", type(engine.engine).__module__
    if role == "decode":
        kv = torch.zeros(PAGES, PAGE_ELEMS, dtype=torch.float16)
        engine.register(kv.data_ptr(), kv.numel() * kv.element_size())
        print(json.dumps([engine.get_session_id(), kv.data_ptr()]), flush=True)
        for line in sys.stdin:
            print(json.dumps(hashlib.sha256(kv.numpy().tobytes()).hexdigest() == line.split()[1]), flush=True)
        return
    session, addr = sys.argv[3], int(sys.argv[4])
    kv = torch.randn(PAGES, PAGE_ELEMS, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    page = PAGE_ELEMS * kv.element_size()
    assert engine.batch_register([kv.data_ptr()], [kv.numel() * kv.element_size()]) == 0
    order = [2, 0, 3, 1]  # pages land in another order than they sit in: spans, not one copy
    rc = engine.batch_transfer_sync(
        session, [kv.data_ptr() + p * page for p in order], [addr + i * page for i in range(PAGES)], [page] * PAGES
    )
    want = hashlib.sha256(kv[order].numpy().tobytes()).hexdigest()
    print(json.dumps([rc, want, engine.send_probe(session)]), flush=True)


if __name__ == "__main__":
    main()
