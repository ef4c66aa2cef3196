"""Expert deferral with the semantics of the sglang-kt fork (kt-kernel's ``select_deferred_experts``).

With d = max_deferred_experts_per_token, each token's top-(K-d) experts by router weight are *protected*. An expert
protected for any token of the batch runs now for every token routed to it; the other (token, expert) pairs are
deferred: layer L computes them after its immediate part and their sum is added to layer L+1's output. The last
layer defers nothing (SGLang passes d = 0 there).
"""

from __future__ import annotations


def split(ids, weights, num_experts: int, deferred: int):
    """ids [T, K] int64, weights [T, K] (any one device) -> (immediate_ids, deferred_ids), each [T, K] with -1
    where not run, on that device; no host synchronization (CUDA-graph capturable)."""
    import torch

    K = ids.shape[1]
    protected_k = max(0, min(K - int(deferred), K))
    if protected_k == K:
        return ids, None
    if protected_k == 0:
        return torch.full_like(ids, -1), ids.clone()
    top = torch.topk(weights, k=protected_k, dim=-1, largest=True, sorted=False).indices
    flag = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    # index_fill_ takes the value as a kernel argument; ``flag[idx] = True`` copies a pageable CPU scalar to the
    # device, which blocks the host behind the stream and is refused under CUDA graph capture (seen on an H100).
    flag.index_fill_(0, torch.gather(ids, -1, top).reshape(-1).clamp(min=0), True)
    protected = flag[ids.clamp(min=0)] & (ids >= 0)
    return ids.masked_fill(~protected, -1), ids.masked_fill(protected, -1)
