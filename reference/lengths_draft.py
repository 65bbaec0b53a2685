"""The lengths-only engine's draft half: the draft-KV map and the group drafting loop on
integer arrays.

`DraftMirror` is mixed into `reference.lengths.LengthsEngine`, which owns the state it reads
and writes: per sequence the draft-KV state (`d_cur`, `d_cap`, `d_filled`, `d_seed`,
`d_pois`, the map membership `d_in` and LRU stamp `d_stamp`, `clock`), the token counts `L`,
`may`, `w`, `max`, `tier_a`, `sc` and the `stalls` counters. It takes exactly the decisions of
`reference.draft` and `reference.simulator`'s draft-KV map (conformance/test_lengths.py
checks the two modes' traces against each other).
"""

from __future__ import annotations

import numpy as np

from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY
from raggedspec.reference.policy import COL, grown_capacity

# Why a row that could draft (u < w, may draft) did not, counted per row-step in
# `LengthsEngine.stalls` (and `Trace.draft_stalls` of a lengths run; not written to the file).
STALL_UNIFORM = "uniform group refused"    # batch_draft_caches None (§9.6) or its set_len refused
STALL_RAGGED = "ragged group refused"      # front_align_draft_group refused (§9.7)
STALL_INELIGIBLE = "no usable draft state"  # budget 0, poisoned, no seed at the chain start (§9.3)


class DraftMirror:
    """`checkout_draft_kv` / `checkin` with LRU eviction, `extend_draft_kv_row` and the
    drafting loop of §9.3, over the engine's arrays (see the module docstring)."""

    def _checkout(self, ids: np.ndarray) -> None:
        """`checkout_draft_kv`: a missing entry becomes a fresh state."""
        fresh = ids[~self.d_in[ids]]
        self.d_cur[fresh], self.d_cap[fresh], self.d_filled[fresh] = 0, DRAFT_CACHE_CAPACITY, 0
        self.d_seed[fresh], self.d_pois[fresh] = -1, False
        self.d_in[ids] = False

    def _checkin(self, ids: np.ndarray) -> None:
        """`checkin` in row order, then LRU eviction down to `max_draft_kv_seqs`."""
        self.d_stamp[ids] = self.clock + 1 + np.arange(ids.shape[0])
        self.clock += ids.shape[0]
        self.d_in[ids] = True
        cap = self.sc.max_draft_kv_seqs
        if cap is not None:
            present = np.flatnonzero(self.d_in)
            if present.shape[0] > cap:
                order = present[np.argsort(self.d_stamp[present])]  # stamps are distinct
                self.d_in[order[: present.shape[0] - cap]] = False

    def _extend(self, ids: np.ndarray, off: np.ndarray, t: int) -> None:
        """`extend_draft_kv_row` for every row (states checked out): poison on False/Err."""
        if self.tier_a:
            return  # check 3 returns True before the seed stash (poisoned states stay poisoned)
        L = self.L[ids]
        ok = ~self.d_pois[ids] & (off <= self.d_filled[ids])
        p = L - 2
        seed_ok = ok & (L >= 2) & (off <= p) & (p < off + t)
        self.d_seed[ids[seed_ok]] = p[seed_ok]
        filled = self.d_filled[ids]
        lo = np.maximum(filled, off)
        hi = np.minimum(off + t, np.maximum(L - 1, 0))
        write = ok & (hi > lo)
        cap = self.d_cap[ids]
        set_ok = filled <= cap
        grown = grown_capacity(cap, hi)
        grow_ok = (hi <= cap) | (grown <= self.max)
        good = write & set_ok & grow_ok
        bad = write & ~(set_ok & grow_ok)
        # set_len(filled) happened before a growth refusal
        self.d_cur[ids[write & set_ok]] = filled[write & set_ok]
        self.d_cur[ids[good]] = hi[good]
        self.d_cap[ids[good]] = grown[good]
        self.d_filled[ids[good]] = hi[good]
        self.d_pois[ids[(~ok) | bad]] = True

    def _draft(self, ids, plan, drafts, rows, res):
        """The group drafting loop (§9.3) over the plan's groups, on lengths: fills `drafts`,
        the rows' group and chain start; returns False when the chain fails the step (a
        capacity refusal)."""
        if not plan.groups:
            return True
        res["groups"] = len(plan.groups)
        start = plan.chain_start
        cand = plan.group_key[:, 0] >= 0
        seed = self.d_seed[ids]
        elig_all = (cand & (plan.budgets > 0) & ~self.d_pois[ids] & (seed >= 0)
                    & (seed == start) & (self.d_filled[ids] >= start))
        self.stalls[STALL_INELIGIBLE] += int((cand & ~elig_all).sum())
        for key, members in plan.groups.items():
            members = np.asarray(members, dtype=np.int64)
            members = members[elig_all[members]]
            if members.shape[0] == 0:
                continue
            st = start[members]
            span = self._group_span(ids[members], st, plan.per_seq)
            if span is None:
                continue
            if not self._draft_group(ids[members], st, span, self.w - key[0]):
                return False
            drafts[members] = self.w - key[0]
            rows[members, COL["group_u"]] = key[0]
            rows[members, COL["group_start"]] = key[1]
            rows[members, COL["chain_start"]] = st
        return True

    def _group_span(self, mids, st, per_seq: bool):
        """The batched draft cache's (length, capacity) for one group (§9.5 uniform, §9.7
        ragged), or None when the group is refused (counted as a stall)."""
        top = int(st.max())
        if per_seq and bool((st != top).any()):
            lead = top - st
            if (st > self.d_cur[mids]).any() or \
                    (np.where(lead > 0, np.maximum(self.d_cap[mids], top), 0) > self.max).any():
                self.stalls[STALL_RAGGED] += mids.shape[0]
                return None
            return top, top
        cur, cap = self.d_cur[mids], self.d_cap[mids]
        if mids.shape[0] > 1 and ((cur != cur[0]).any() or (cap != cap[0]).any()):
            self.stalls[STALL_UNIFORM] += mids.shape[0]
            return None
        if st[0] > cap[0]:
            self.stalls[STALL_UNIFORM] += mids.shape[0]
            return None
        return int(st[0]), int(cap[0])

    def _draft_group(self, mids, st, span, n_draft: int) -> bool:
        """Run one group's chain of `n_draft` steps on lengths; False on a capacity refusal."""
        bcur, bcap = span
        top = int(st.max())
        for _ in range(n_draft):
            if bcur + 1 > bcap:
                bcap = int(grown_capacity(bcap, bcur + 1))
                if bcap > self.max:
                    return False
            bcur += 1
        lead = top - st  # zeros unless ragged: a uniform group shares one chain start
        self.d_cur[mids] = bcur - lead
        self.d_cap[mids] = bcap - lead
        self.d_filled[mids] = st + 1
        return True
