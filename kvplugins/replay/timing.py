"""The replay's TTFT model (``--prefill-tok-s`` > 0): a simulated clock over the trace's arrival times (run
``speed`` times faster), each instance serving its requests one after another (FIFO), a request's service time
that of kvplugins/router/cost.py (prefill of the blocks no cache holds, the pool's blocks loaded). Per request:
TTFT = its wait for the instance + its service. With ``--routing conductor`` the instance is the Conductor's
choice over the instances' queues, own caches and the pool (the same code a deployed router runs), and with a
TTFT SLO it rejects early what it predicts would miss it.
"""

from __future__ import annotations

from kvplugins.router.cost import Candidate, Conductor, CostModel


class Timing:
    """The clock and queues of one replay of ``plan`` (runner.Plan) over ``instances`` (runner._Instance)."""

    def __init__(self, plan, instances):
        self.plan, self.insts = plan, instances
        self.model = CostModel(plan.prefill_tok_s, plan.load_bytes_s, plan.block_tokens, plan.block_bytes)
        self.conductor = Conductor(self.model, plan.slo_ms / 1000) if plan.routing == "conductor" else None
        self.busy = [0.0] * len(instances)  # simulated s at which each instance is free
        self.first: float | None = None

    def now(self, req) -> float:
        if self.first is None:
            self.first = req.timestamp_ms
        return (req.timestamp_ms - self.first) / 1000 / self.plan.clock

    def choose(self, req, res) -> int | None:
        """The Conductor's instance for ``req``, or None (rejected: counted in ``res``)."""
        assert self.conductor is not None
        now = self.now(req)
        pool = self.insts[0].pool
        stored = pool.prefix(pool.keys(req.blocks)) if pool is not None else 0
        cands = []
        for i, inst in enumerate(self.insts):
            local = inst.local.prefix(req.blocks) if inst.local else 0
            cands.append(Candidate(i, self.busy[i] - now, local, max(0, stored - local)))
        d = self.conductor.choose(req.input_length, cands)
        if d.rejected:
            res.rejected += 1
            return None
        return d.index

    def served(self, i: int, req, local: int, pooled: int, res) -> None:
        """Instance ``i`` served ``req`` with ``local`` blocks from its cache and ``pooled`` from the pool."""
        now = self.now(req)
        start = max(now, self.busy[i])
        self.busy[i] = start + self.model.service_s(req.input_length, local, pooled)
        ttft_ms = (self.busy[i] - now) * 1000
        res.ttft_ms.append(ttft_ms)
        res.slo_met += bool(self.plan.slo_ms) and ttft_ms <= self.plan.slo_ms
        res.span_s = max(res.span_s, now)
