"""One side of vLLM 0.32's encoder-cache Mooncake transfer (``MooncakeTransfer``,
distributed/ec_transfer/ec_connector/mooncake/transfer.py: what ECMooncakeConnector's producer pushes encoder
outputs into a consumer's memory with) on kvplugins through the ``mooncake.engine`` shim (site dir: argv[2]).

    python ec_mooncake_worker.py consumer SITE   registers a zeroed [ROWS, DIM] bf16 tensor (the consumer's
                                                 encoder cache), prints its session and address, then on
                                                 "check <hex digest>" answers whether its bytes hash so
    python ec_mooncake_worker.py producer SITE SESSION ADDR
                                                 splits one encoder output into sibling views of one storage,
                                                 acquires them as transient sources (one registration per view),
                                                 writes them into the consumer's rows in another order, releases
                                                 them; prints the digest the consumer should hold
"""

from __future__ import annotations

import hashlib
import json
import site
import sys

site.addsitedir(sys.argv[2])
import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.mooncake.transfer import MooncakeTransfer  # noqa: E402

ROWS, DIM, ITEMS = 96, 512, 4  # 4 multimodal items of 24 encoder tokens, bf16


def main() -> None:
    role = sys.argv[1]
    xfer = MooncakeTransfer("127.0.0.1", "tcp")
    if role == "consumer":
        cache = torch.zeros(ROWS, DIM, dtype=torch.bfloat16)
        assert xfer.register_memory(cache) == 0
        print(json.dumps([xfer.local_session(), cache.data_ptr()]), flush=True)
        for line in sys.stdin:
            print(json.dumps(hashlib.sha256(cache.view(torch.uint8).numpy().tobytes()).hexdigest() == line.split()[1]),
                  flush=True)  # fmt: skip
        assert xfer.unregister_memory(cache)
        xfer.close()
        return
    session, addr = sys.argv[3], int(sys.argv[4])
    out = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    views = list(torch.split(out, ROWS // ITEMS))  # sibling views of one storage, as an encoder batch splits
    sources = xfer.acquire_sources(views)
    again = xfer.acquire_sources(views[:1])  # a second batch referencing a source still registered
    order = [3, 1, 0, 2]
    row_bytes = DIM * out.element_size()
    dests = [addr + i * (ROWS // ITEMS) * row_bytes for i in range(ITEMS)]
    xfer.write(session, [sources[j] for j in order], dests, [views[j].nbytes for j in order])
    released = [xfer.release_sources(sources), xfer.release_sources(again)]
    want = torch.cat([views[j] for j in order])
    print(json.dumps([released, hashlib.sha256(want.view(torch.uint8).numpy().tobytes()).hexdigest()]), flush=True)
    xfer.close()


if __name__ == "__main__":
    main()
