"""The lengths-only engine's scheduler: `scheduler.schedule` on the batch's integer arrays.

`ScheduleMirror` is the scheduler half of `reference.lengths.LengthsEngine`: the keys per
world encoded as integers (`2 * len + ragged_flag`, tuple order), bucket selection with the
coalescing payback and the WA floor, urgency, and the admission of the waiting queue next to
the running set (`admit_waiting`, a cumulative-sum expression rather than a loop over the
waiting list). It takes exactly `reference.scheduler`'s decisions, ties included
(conformance/test_lengths_halves.py checks both against each other).
"""

from __future__ import annotations

import math

import numpy as np

from raggedspec.reference.scheduler import COALESCE_PAYBACK_STEPS


def admit_waiting(new: np.ndarray, room: int, cap: int | None) -> np.ndarray:
    """`scheduler.schedule`'s admission of the waiting queue (sorted by id) next to running
    sequences, vectorized: the sequential rule "admit while the running set has room, but at
    most `cap` never-admitted (`new`) sequences" admits exactly the first `room` of the
    candidates, where the candidates are every previously admitted sequence and the first
    `cap` new ones (room and the new count only grow along the queue, so once a sequence is
    refused for room every later one is too). Returns the admitted mask.
    conformance/test_lengths_halves.py checks it against the sequential loop."""
    new = np.asarray(new, dtype=bool)
    cand = ~new if cap is not None else np.ones(new.shape, dtype=bool)
    if cap is not None:
        cand |= new & (np.cumsum(new) <= cap)
    return cand & (np.cumsum(cand) <= room)


class ScheduleMirror:
    """`scheduler.schedule` over the engine's arrays. The engine provides `sc`, `max`, `L`,
    `stored`, `is_prompt`, `granted`, `ragged_supported`, `urg`, `admitted`, `running`,
    `waiting`, `floor_count`, `sched` (BucketTelemetry) and `log2` (None until first used)."""

    def _log2(self, n: np.ndarray) -> np.ndarray:
        """`math.log2` values (bit-identical to the scheduler's) from a lookup table."""
        top = int(n.max(initial=1)) + 1
        if self.log2 is None or self.log2.shape[0] < top:
            size = max(top, self.max + 2)
            self.log2 = np.array([0.0] + [math.log2(i) for i in range(1, size)], dtype=np.float64)
        return self.log2[n]

    def _keys(self, run: np.ndarray) -> np.ndarray:
        """Scheduler key of each running id, encoded `2 * len + ragged_flag` (tuple order)."""
        prompt = self.is_prompt[run]
        klen = np.where(prompt, np.maximum(self.L[run] - 1, 0), self.stored[run])
        world = self.sc.world
        if world == "WA" and self.ragged_supported:
            klen = np.where(prompt, klen, 0)
        flag = np.zeros(run.shape[0], dtype=np.int64)
        if world == "WB" and self.granted and (~prompt).any():
            rl = int(self.stored[run][~prompt].min())
            klen = np.where(prompt, klen, rl)
            flag = (~prompt).astype(np.int64)
        return 2 * klen + flag

    def _key_tuple(self, code: int) -> list:
        klen, flag = divmod(int(code), 2)
        key = [klen, False, 0]
        if self.sc.world == "WB":
            key.append(bool(flag))
        return key

    def _schedule(self):
        """Mirror of `scheduler.schedule` (conformance/test_lengths_halves.py compares them)."""
        sc = self.sc
        running, waiting = self.running, self.waiting
        if not running and not waiting:
            return None
        cap = sc.prefill_max_seqs if sc.world == "WA" else None
        max_seqs = sc.max_seqs if sc.max_seqs is not None else 1 << 30
        # every running id was marked admitted when it last ran, and the admission below reads
        # only the waiting ids' marks
        if not running:
            discrete = True
            run = list(waiting[:cap])  # [:None] is the whole queue
            held: list[int] = [] if cap is None else waiting[cap:]
        else:
            discrete = not waiting
            wait = np.sort(np.asarray(waiting, dtype=np.int64))
            take = admit_waiting(~self.admitted[wait], max_seqs - len(running), cap)
            run = list(running) + wait[take].tolist()
            held = wait[~take].tolist()
        run_arr = np.array(run, dtype=np.int64)
        self.admitted[run_arr] = True
        keys = self._keys(run_arr)
        uniq, first_idx, inv = np.unique(keys, return_index=True, return_inverse=True)
        n_buckets = uniq.shape[0]  # the WA transition log line is not traced
        if n_buckets <= 1:
            key = int(uniq[0])
        else:
            key = self._select(uniq, inv, run_arr, discrete)
            if sc.world == "WA" and sc.prefill_floor is not None and not discrete:
                prompt_codes = uniq[self.is_prompt[run_arr[first_idx]]]
                if key in set(prompt_codes.tolist()):
                    self.floor_count = 0
                elif self.floor_count >= sc.prefill_floor and prompt_codes.size:
                    self.floor_count = 0
                    key = int(prompt_codes.min())
                else:
                    self.floor_count += 1
        chosen_mask = keys == key
        chosen = run_arr[chosen_mask]
        rest = run_arr[~chosen_mask]
        self.urg[chosen] = 0
        self.urg[rest] += 1
        self.sched.record_bucketing(int(n_buckets), len(run), int(chosen.shape[0]))
        self.waiting = held + rest.tolist()
        return chosen, key, int(n_buckets)

    def _select(self, uniq: np.ndarray, inv: np.ndarray, run: np.ndarray, discrete: bool) -> int:
        """`select_running_bucket` over encoded keys (ties as reference.scheduler breaks them)."""
        lo = int(uniq[0])
        if discrete:
            return lo
        prio = np.bincount(inv, weights=self.urg[run].astype(np.float64) + self._log2(self.L[run]),
                           minlength=uniq.shape[0])
        best = prio.max()
        greedy = int(uniq[np.flatnonzero(prio == best)[0]])
        if greedy == lo:
            return lo
        lo_len, lo_flag = divmod(lo, 2)
        lens, flags = np.divmod(uniq, 2)
        above = lens[(lens > lo_len) & (flags == lo_flag)]
        if above.size == 0:
            return greedy
        sizes = np.bincount(inv, minlength=uniq.shape[0])
        n_min, total = int(sizes[0]), int(sizes.sum())
        gap = int(above.min()) - lo_len
        return lo if (total - n_min) * gap <= n_min * COALESCE_PAYBACK_STEPS else greedy
