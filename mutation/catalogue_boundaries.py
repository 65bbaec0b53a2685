"""Catalogue entries for the boundary cases the boundary generators reach.

Each entry plants one bug that only an input at a boundary exposes: the capacity a K/V append
needs exactly at `max_seq_len`, a growth exactly one 512-column block past the capacity, the
64-entry draft map, positions bfloat16 cannot hold (odd, above 256) in RoPE and in the in-place
attention's masks, the token budget clamp at a small `max_seq_len` (on rows decoding alone, and
on the rows of one step with different `u`), the kernel backend's own RoPE, and a draft chain's
capacity arithmetic. The named tests (mostly `conformance/test_boundaries.py`) must then fail.
Rows are `(name, file, old, new, spec, tests)` and `mutation/catalogue.py` turns them into
entries.
"""

from __future__ import annotations

BOUNDARIES = "conformance/test_boundaries.py"

BOUNDARY_MUTANTS: list[tuple[str, str, str, str, str, tuple[str, ...]]] = [
    (
        "grown_capacity: refused when the grown capacity equals max_seq_len",
        "reference/cache.py",
        "    if grown > max_seq_len:\n        raise CacheRefusal(f\"kv-cache capacity {grown}",
        "    if grown >= max_seq_len:\n        raise CacheRefusal(f\"kv-cache capacity {grown}",
        "C§3 capacity vs max_seq_len",
        (BOUNDARIES,),
    ),
    (
        "grown_capacity: one block too many when the shortfall is a whole block",
        "reference/cache.py",
        "grown = capacity + -(-(held + s - capacity) // CACHE_GROW_SIZE) * CACHE_GROW_SIZE",
        "grown = capacity + -(-(held + s - capacity + 1) // CACHE_GROW_SIZE) * CACHE_GROW_SIZE",
        "C§3 512-column blocks",
        (BOUNDARIES,),
    ),
    (
        "grown_capacity: grows when the append exactly fills the capacity",
        "reference/cache.py",
        "    if held + s <= capacity:",
        "    if held + s < capacity:",
        "C§3 capacity (the draft cache's 16 columns, each 512 block)",
        (BOUNDARIES,),
    ),
    (
        "chain_capacity: the refusal names the chain's last block, not the first one refused",
        "reference/cache.py",
        "        grown = capacity + max(first_over, 1) * CACHE_GROW_SIZE",
        "        grown = capacity + blocks * CACHE_GROW_SIZE",
        "C§3 a chain's one-column appends",
        ("conformance/test_cache.py",),
    ),
    (
        "chain_capacity: a chain that reaches max_seq_len exactly is refused",
        "reference/cache.py",
        "    first_over = (max_seq_len - capacity) // CACHE_GROW_SIZE + 1",
        "    first_over = (max_seq_len - capacity - 1) // CACHE_GROW_SIZE + 1",
        "C§3 a chain's one-column appends",
        ("conformance/test_cache.py",),
    ),
    (
        "TorchBackend.new_draft_cache: a draft row starts at 32 columns, not 16",
        "gpu/backend.py",
        "return PoolKv(stores[hd], model.cfg.max_seq_len, DRAFT_CACHE_CAPACITY)",
        "return PoolKv(stores[hd], model.cfg.max_seq_len, 2 * DRAFT_CACHE_CAPACITY)",
        "C§3 the draft cache's 16 columns",
        (BOUNDARIES,),
    ),
    (
        "DraftKvMap.checkin: evicts down to 63 entries instead of 64",
        "reference/draft.py",
        "        while len(self.entries) > MAX_DRAFT_KV_SEQS:",
        "        while len(self.entries) >= MAX_DRAFT_KV_SEQS:",
        "C§7.1 draft map",
        (BOUNDARIES,),
    ),
    (
        "rope_cos_sin: positions rounded to the tensor dtype before the angle",
        "gpu/rope.py",
        "    angle = positions[..., None]",
        "    angle = positions.to(dtype).to(torch.float64)[..., None]",
        "M§11 RoPE positions",
        (BOUNDARIES,),
    ),
    (
        "dsv4_attention_in_place: query positions held in the query dtype",
        "gpu/attention.py",
        "    qp = (lens - t_q)[:, None] + arange_like(t_q, lens)[None, :]",
        "    qp = ((lens - t_q)[:, None] + arange_like(t_q, lens)).to(q.dtype).long()",
        "M§4 masks",
        (BOUNDARIES,),
    ),
    (
        "TorchBackend.budget_clamp: one token more than the budget",
        "gpu/backend.py",
        "return [step.budget_clamp(a, b) for a, b in zip(accepted, budgets, strict=False)]",
        "return [step.budget_clamp(a, b + 1) for a, b in zip(accepted, budgets, strict=False)]",
        "C§11.2 budget clamp",
        (BOUNDARIES,),
    ),
    (
        "TorchBackend.budget_clamp: every row clamped by the batch's smallest budget",
        "gpu/backend.py",
        "return [step.budget_clamp(a, b) for a, b in zip(accepted, budgets, strict=False)]",
        "return [step.budget_clamp(a, min(budgets, default=0)) for a in accepted]",
        "C§11.2 budget clamp (per row: rows of different u have different budgets)",
        (BOUNDARIES,),
    ),
    (
        "CupyBackend.apply_rope: the inverse flag dropped",
        "gpu/cupy_backend.py",
        "        return self._rope(self._t(x), offsets, rope_dims, theta, inverse)",
        "        return self._rope(self._t(x), offsets, rope_dims, theta, False)",
        "M§11 RoPE",
        (BOUNDARIES,),
    ),
]
