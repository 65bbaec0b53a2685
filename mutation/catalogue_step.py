"""Catalogue entries for cache-and-draft.md §18, the step side: verification, the budget clamp, the
cohort and per-sequence advance plans, cache truncation, front alignment and the accounting.

Entries are `Mutant`s built with `M` (mutation/mutant.py); `mutation.catalogue` joins
the families, in order, into its public lists.
"""

from __future__ import annotations

from raggedspec.mutation.mutant import (
    ACC,
    ALIGN,
    CAP,
    KILLS,
    R_ACC,
    R_ALIGN,
    R_CAP,
    R_DISP,
    R_STEP,
    SPEC_GAPS,
    STEP,
    M,
    Mutant,
)

ENTRIES: list[Mutant] = [
    M(
        "verify_proposed: compare target[i+1]",
        R_STEP,
        "        if proposed[i] != target[i]:\n",
        "        if proposed[i] != target[min(i + 1, len(target) - 1)]:\n",
        "C§18",
        STEP,
    ),
    M(
        "verify_proposed: rejection token taken from proposed",
        R_STEP,
        "(i, int(target[i]))",
        "(i, int(proposed[i]))",
        "C§18",
        STEP,
    ),
    M(
        "budget clamp: n_acc = budget (not budget - 1)",
        R_STEP,
        "    return _sat(budget - 1) if accepted + 1 > budget else accepted\n",
        "    return budget if accepted + 1 > budget else accepted\n",
        "C§18",
        STEP,
    ),
    M(
        "plan_batch_step: max not min",
        R_STEP,
        "    keep = min(valid) if valid else 0\n",
        "    keep = max(valid) if valid else 0\n",
        "C§18; M§23",
        STEP,
    ),
    M(
        "plan_batch_step: next = u + a - keep",
        R_STEP,
        "[_sat(v + 1 - keep) for v in valid]",
        "[_sat(v - keep) for v in valid]",
        "C§18; M§23",
        STEP,
    ),
    M(
        "plan_batch_step: n_drop = w - keep + 1",
        R_STEP,
        "CohortPlan(keep, _sat(w - keep),",
        "CohortPlan(keep, _sat(w - keep + 1),",
        "C§18; M§23",
        STEP,
    ),
    M(
        "plan_per_sequence_step: committed = min(u + a, batch min)",
        R_STEP,
        "    committed = [min(int(u) + int(a), w) for u, a in zip(uncached, accepted, "
        "strict=False)]\n",
        "    committed = [min(int(u) + int(a), w, min(int(x) + int(y) for x, y in zip(uncached, "
        "accepted, strict=False)))"
        " for u, a in zip(uncached, accepted, strict=False)]\n",
        "C§18; M§23",
        STEP,
    ),
    M(
        "plan_per_sequence_step: next_u = u + a",
        R_STEP,
        "[1] * len(committed)",
        "[int(u) + int(a) for u, a in zip(uncached, accepted)]",
        "C§18",
        STEP,
    ),
    M(
        "plan_per_sequence_step: committed not capped at w",
        R_STEP,
        "    committed = [min(int(u) + int(a), w) for u, a in zip(uncached, accepted, "
        "strict=False)]\n",
        "    committed = [int(u) + int(a) for u, a in zip(uncached, accepted, strict=False)]\n",
        "C§18",
        STEP,
    ),
    M(
        "plan_per_sequence_step: dropped = committed",
        R_STEP,
        "[_sat(w - c) for c in committed]",
        "list(committed)",
        "C§18",
        STEP,
    ),
    M(
        "per-seq commit: set_len(C + c) (the padded width) not cache_len_i + c",
        R_STEP,
        "    target = cache_len + committed\n",
        "    target = cache_len + lead + committed\n",
        "C§18",
        STEP,
    ),
    M(
        "per-seq commit: skip drop_dead_prefix",
        R_STEP,
        "            drop_dead_prefix(slot, lead)\n",
        "            pass\n",
        "C§18",
        STEP,
    ),
    M(
        "per-seq commit: strip after set_len",
        R_STEP,
        "        try:\n            drop_dead_prefix(slot, lead)\n        except CacheRefusal as "
        "err:\n"
        "            raise StepRefusal(\n"
        '                f"stripping the {lead}-column dead prefix failed on slot {i}: {err}") '
        'from err\n'
        "        try:\n            slot.set_len(target)\n        except CacheRefusal as err:\n"
        '            raise StepRefusal(f"set_len({target}) refused on slot {i}: {err}") from err\n',
        "        try:\n            slot.set_len(target)\n        except CacheRefusal as err:\n"
        '            raise StepRefusal(f"set_len({target}) refused on slot {i}: {err}") from err\n'
        "        try:\n            drop_dead_prefix(slot, lead)\n        except CacheRefusal as "
        "err:\n"
        "            raise StepRefusal(\n"
        '                f"stripping the {lead}-column dead prefix failed on slot {i}: {err}") '
        'from err\n',
        "C§18",
        STEP,
    ),
    M(
        "truncate_cache_by: layer 0 only",
        R_STEP,
        "    for slot in cache.slots:\n",
        "    for slot in cache.slots[:1]:\n",
        "C§18",
        STEP,
    ),
    M(
        "truncate_cache_by: non-saturating subtraction",
        R_STEP,
        "        new = _sat(cur - n_drop)\n",
        "        new = cur - n_drop\n",
        "C§18",
        STEP,
    ),
    M(
        "truncate_cache_by: ignore set_len errors",
        R_STEP,
        "        except CacheRefusal as err:\n            raise StepRefusal(\n"
        '                f"MTP: cache set_len({new}) failed rolling back {n_drop} of {cur} '
        'positions: {err}"\n'
        "            ) from err\n",
        "        except CacheRefusal as err:\n            pass\n",
        "C§18",
        STEP,
    ),
    M(
        "window_guard: drop the PerSequence follows guard (the PR's added guard)",
        R_STEP,
        '    if advance is KvAdvance.PER_SEQUENCE:\n        return "follows_guard"\n',
        "",
        "C§16 step 4; PR",
        STEP,
    ),
    M(
        "per_seq_advance: ignore assembled_here",
        R_STEP,
        "    return assembled_here and post_op_out and advance",
        "    return post_op_out and advance",
        "C§16 step 3",
        STEP,
    ),
    M(
        "per_sequence_refusal: drop the cache-support check",
        R_CAP,
        "        lambda: cache_supports_per_sequence_advance(cache, xs_per_seq),\n",
        "",
        "C§18",
        CAP,
    ),
    M(
        "per_sequence_refusal: drop the mask check",
        R_CAP,
        "        lambda: model_masks_ragged_batches(cache),\n",
        "",
        "C§18",
        CAP,
    ),
    M(
        "per_sequence_refusal: reorder (mask before support)",
        R_CAP,
        "        lambda: cache_supports_per_sequence_advance(cache, xs_per_seq),\n"
        "        lambda: model_masks_ragged_batches(cache),\n",
        "        lambda: model_masks_ragged_batches(cache),\n"
        "        lambda: cache_supports_per_sequence_advance(cache, xs_per_seq),\n",
        "C§18",
        CAP,
    ),
    M(
        "kv_advance: grant on the flag alone",
        R_CAP,
        "        refusal = per_sequence_refusal(cache, self.xs_per_seq, self.admission)\n",
        "        refusal = None\n",
        "C§18",
        CAP,
    ),
    M(
        "kv_advance: don't latch",
        R_CAP,
        "        if self.decision is not None:\n",
        "        if False:\n",
        "C§18",
        CAP,
    ),
    M(
        'per_sequence_kv_requested: accept "yes"',
        R_CAP,
        '(value == "1" or value.lower() == "true")',
        '(value in ("1", "yes") or value.lower() == "true")',
        "C§18",
        CAP,
    ),
    M(
        "xs_per_sequence_enabled: case-insensitive",
        R_CAP,
        '    return value in ("1", "true", "TRUE")\n',
        '    return value is not None and value.lower() in ("1", "true")\n',
        "C§18",
        CAP,
    ),
    M(
        "cache_supports_per_sequence_advance: ignore the xs flag",
        R_CAP,
        "        if not slot.supports_per_sequence_len(xs_per_seq):\n",
        "        if not slot.supports_per_sequence_len(True):\n",
        "C§18",
        CAP,
    ),
    M(
        "front_pad_single: copy to [0, live) (no shift)",
        R_ALIGN,
        "    fresh[:, :, lead:target, :] = sc.data[:, :, :live, :]\n",
        "    fresh[:, :, :live, :] = sc.data[:, :, :live, :]\n",
        "C§18; M§23",
        ALIGN,
    ),
    M(
        "front_pad_single: capacity = target even when capacity > target",
        R_ALIGN,
        "    cap = max(sc.capacity_seq_len, target)\n    b, h, _, d = sc.data.shape\n",
        "    cap = target\n    b, h, _, d = sc.data.shape\n",
        "C§18",
        ALIGN,
    ),
    M(
        "front_pad_single: no max_seq_len refusal",
        R_ALIGN,
        "    if cap > sc.max_seq_len:\n",
        "    if False:\n",
        "C§18",
        ALIGN,
    ),
    M(
        "drop_front_single: narrow(lead, current - lead) not (lead, width - lead)",
        R_ALIGN,
        "    kept = width - lead\n    sc.data = sc.data[:, :, lead:width, :].copy()\n",
        "    kept = sc.current_seq_len - lead\n    sc.data = sc.data[:, :, "
        "lead:sc.current_seq_len, :].copy()\n",
        "C§18",
        ALIGN,
    ),
    M(
        "drop_front_single: capacity unchanged",
        R_ALIGN,
        "    sc.capacity_seq_len = kept\n    sc.current_seq_len -= lead\n",
        "    sc.current_seq_len -= lead\n",
        "C§18",
        ALIGN,
    ),
    M(
        "drop_front_single: no lead > current refusal",
        R_ALIGN,
        "    if lead > n:\n",
        "    if False:\n",
        "C§18",
        ALIGN,
    ),
    M(
        "front_align_batch: target from slot 0 only",
        R_ALIGN,
        "    return max((slot.current_seq_len for c in caches for slot in c.slots), default=0)\n",
        "    return max((c.slots[0].current_seq_len for c in caches), default=0)\n",
        "C§18",
        ALIGN,
    ),
    M(
        "front_align_batch: lead from the last slot even if XsRolling",
        R_ALIGN,
        "            if slot.kind != XS:\n                lead = slot_lead\n",
        "            lead = slot_lead\n",
        "C§18; M§23",
        ALIGN,
    ),
    M(
        "from_fused_verify: reached = a + 1 uncapped by d",
        R_ACC,
        "0 if d == 0 else min(a + 1, d)",
        "0 if d == 0 else a + 1",
        "C§18",
        ACC,
    ),
    M(
        "from_fused_verify: committed = 1 + a + [a < d]",
        R_ACC,
        "min(a + 1, d), 1 + a)",
        "min(a + 1, d), 1 + a + int(a < d))",
        "C§18",
        ACC,
    ),
    M(
        "from_fused_verify: count d = 0 as drafted",
        R_ACC,
        "drafted_steps=int(d > 0)",
        "drafted_steps=1",
        "C§18",
        ACC,
    ),
    M(
        "accumulate: fire on total % every == 0 (misses straddles)",
        R_ACC,
        "return every > 0 and (before + p) // every != before // every",
        "return every > 0 and (before + p) % every == 0",
        "C§18",
        ACC,
    ),
    M(
        "accumulate: fire on p = 0",
        R_ACC,
        "return every > 0 and (before + p) // every != before // every",
        "return every > 0 and ((before + p) // every != before // every or p == 0)",
        "C§18",
        ACC,
    ),
    M(
        "record_batch: count batch_steps once per sequence",
        R_ACC,
        "        self.total.batch_steps += 1\n",
        "        self.total.batch_steps += len(per_seq)\n",
        "C§18",
        ACC,
    ),
    M(
        "resolve_row_offsets: a row without an override gets 0, not the shared offset",
        R_DISP,
        "    return [shared if o is None else o for o in vals]\n",
        "    return [0 if o is None else o for o in vals]\n",
        "M§22 (dispatch tests)",
        SPEC_GAPS,
        KILLS,
    ),
    M(
        "resolve_row_offsets: always the per-row vector",
        R_DISP,
        "    if all(o is None for o in vals):\n        return None\n",
        "    if not vals:\n        return None\n",
        "M§22 (dispatch tests)",
        SPEC_GAPS,
        KILLS,
    ),
    M(
        "resolve_row_offsets: collapse equal overrides to the scalar path",
        R_DISP,
        "    if all(o is None for o in vals):\n        return None\n",
        "    if all(o is None for o in vals) or len(set(vals)) == 1:\n        return None\n",
        "M§22 (dispatch tests)",
        SPEC_GAPS,
        KILLS,
    ),
]
