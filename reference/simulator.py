"""Tensor-mode step simulator: the engine loop driving the real reference functions.

Per engine step (masks-and-scheduling.md §20): arrivals join the waiting queue;
`scheduler.schedule` picks one bucket (keys per world, coalescing, the WA floor);
`plan_engine_iteration`-style cache instructions (`In` / `Nothing`, prompts `Reset`); the
completion forward is one MTP decode step exactly as cache-and-draft.md §16 lays it out:

1. pre-op `In`: `align.clone_in_cache_reporting_lead` (strip pending leads, front-align under
   PerSequence, publish `ragged_decode_supported` to the WA channel), `assembled_here`;
   `Nothing`: the resident batched cache as is;
2. `per_seq_advance`, `resolve_row_cache_lens`, `plan_step_window` and the two guards
   (`step.window_guard`): refuse, or defer (clear the draft map, one plain decode);
3. budgets, draft-state checkout, `draft_groups`, the group loop
   (`draft.group_drafting_loop`: `batch_draft_caches` / `front_align_draft_group`,
   `propose_chain_batched` with per-row or shared positions, `split_draft_cache`,
   `drop_dead_prefix`);
4. the verify forward on `model.TinyModel` (`[B, w]` windows, per-row positions `cache_lens`
   with `row_q0`, or the shared offset C), capturing the pre-norm hidden;
5. accept (`verify_proposed` on the token oracle's drafts and targets, `budget_clamp`),
   commit; advance (`plan_batch_step` + `truncate_cache_by`, or `plan_per_sequence_step`);
   `extend_draft_kvs`; accounting (`record_step`, `record_batch`);
6. post-op `Out`: `clone_out_cache` (pending leads recorded), and under PerSequence the
   per-sequence commit per the strip policy (eager: `step.commit_per_sequence`).
Prompt forwards (`Reset`) run the target on the prompt and prime the draft KV
(`draft.prime_draft_kv`, §7.4). Lengths in the trace are read back off the caches.

Control flow never reads a float: drafts and targets come from the token oracle
(`reference.acceptance`); the MTP block's own argmax chain is run (it fills the draft KV
tensors) but its tokens are not used. The tiny model's XsRolling slots (one per compressed
layer, after the K/V slots, as on V4) are fed the verify forward's final hidden rows: a
stand-in that keeps their per-row token counts, rollback and capability rules exercised (the
model computes its compressed keys from the raw K cache).

Shared choices with the lengths mode are listed in `reference.lengths`' docstring.
`record_tensors=True` keeps per step the verify forward's inputs and outputs (tokens,
positions, row_q0, leads, hidden, logits) and a copy of the batched target cache's layer-0 K,
for a later backend to compare step by step.
"""

from __future__ import annotations

import numpy as np

from reference.acceptance import build_model, build_oracle
from reference.accounting import AcceptanceTelemetry, from_fused_verify
from reference.align import clone_in_cache_reporting_lead, clone_out_cache
from reference.cache import KvCache, NormalCache
from reference.capability import KvAdvance
from reference.dispatch import (MtpHiddenCapture, chain_start_of, draft_group_key, draft_groups,
                                ragged_row_q0, resolve_row_cache_lens)
from reference.draft import DraftKvMap, extend_draft_kvs, group_drafting_loop, prime_draft_kv
from reference.errors import CacheRefusal, DispatchRefusal, Refusal, StepRefusal
from reference.lengths import (ERR_CAPACITY, ERR_CHAIN, ERR_CLONE_IN, ERR_COMMIT, ERR_GUARD_FOLLOWS, ERR_GUARD_LEFT,
                               ERR_XS_ROLLBACK, NCOL, ROW_DTYPE, advance_latch, guard_error, step_fields, summarize)
from reference.model import TinyModel
from reference.scenario import Scenario, load_scenario, model_config
from reference.scheduler import (PrefillFloor, RaggedAdmission, SchedulerState, SeqRecord,
                                 engine_cache_instruction, install_admission, schedule)
from reference.step import (budget_clamp, commit_per_sequence, plan_batch_step, plan_per_sequence_step,
                            plan_step_window, token_budget, truncate_cache_by, verify_proposed, window_guard)
from reference.trace import Trace
from reference.xs_rolling import XsRolling



class _StepFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class SizedDraftKvMap(DraftKvMap):
    """`DraftKvMap` with the LRU capacity of the scenario (`max_draft_kv_seqs`; arc: 64;
    None = unbounded)."""

    def __init__(self, block, cap: int | None) -> None:
        super().__init__(block)
        self.cap = cap

    def checkin(self, seq_id, state) -> None:
        self._clock += 1
        state.last_used = self._clock
        self.entries[seq_id] = state
        while self.cap is not None and len(self.entries) > self.cap:
            oldest = min(self.entries, key=lambda k: self.entries[k].last_used)
            del self.entries[oldest]


class TensorEngine:
    """The tensor-mode engine (module docstring); `run()` returns the Trace."""

    def __init__(self, sc: Scenario, progress=None, record_tensors: bool = False) -> None:
        self.sc, self.progress, self.record = sc, progress, record_tensors
        self.w = sc.depth + 1
        self.mtp = sc.depth > 0
        self.cfg = model_config(sc)
        self.model = TinyModel(self.cfg)
        self.oracle = build_oracle(build_model(sc.acceptance, sc.seed, sc), sc.seed, self.cfg.vocab)
        self.latch, kv = advance_latch(sc)
        self.kv = kv if self.mtp else KvAdvance.COHORT
        self.per_seq = self.kv is KvAdvance.PER_SEQUENCE
        self.state = SchedulerState(world=sc.world, max_seqs=sc.max_seqs or (1 << 30),
                                    prefill_cap=sc.prefill_max_seqs, floor=PrefillFloor(sc.prefill_floor))
        granted = sc.world == "WB" and self.per_seq
        install_admission(self.state, RaggedAdmission.decide(None if granted else "per-sequence advance not granted"))
        self.dmap = SizedDraftKvMap(self.model.mtp, sc.max_draft_kv_seqs)
        self.tel = AcceptanceTelemetry(logging_enabled=False)
        self.caches: dict[int, NormalCache] = {}
        self.pending: dict[int, int] = {}
        self.toks: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.resident = None  # (ids, batched NormalCache, phys leads)
        self.errors = 0
        self.messages: list[str] = []

    # ------------------------------------------------------------------ helpers
    def new_cache(self, batch: int) -> NormalCache:
        """The V4-shaped target cache: K/V slots, then one XsRolling slot per compressed layer."""
        slots = [KvCache.new_normal(self.sc.max_seq_len) for _ in self.cfg.compress_ratios]
        slots += [XsRolling(r, max_seq_len=self.sc.max_seq_len, batch=batch) for r in self.cfg.compress_ratios if r > 0]
        return NormalCache(slots)

    def _forward(self, tokens, cache: NormalCache, offsets, row_q0, lead_pad, capture=None):
        try:
            fwd = self.model.forward(tokens, cache, offsets, row_q0, lead_pad, capture)
            for slot in cache.slots:
                if isinstance(slot, XsRolling):
                    slot.append_rows(fwd.hidden)
        except Refusal as exc:
            raise _StepFailed(ERR_CAPACITY, str(exc)) from exc
        return fwd

    def _record(self, cache, entry: dict) -> dict | None:
        if not self.record:
            return None
        slot = cache.slots[0]
        entry["target_k0"] = None if slot.k.current_data() is None else slot.k.current_data().copy()
        return entry

    def _terminal(self, i: int) -> bool:
        r = self.sc.requests[i]
        n = len(self.toks[i])
        return n - r.prompt_len >= r.max_new_tokens or n >= self.sc.max_seq_len

    def _fail(self, ids, exc: _StepFailed) -> str:
        for i in ids:
            self.done.add(i)
            self.dmap.entries.pop(i, None)
        self.errors += 1
        self.messages.append(f"{exc.kind}: {exc.detail}")
        return exc.kind

    def _filled(self, i: int) -> int:
        st = self.dmap.entries.get(i)
        return 0 if (st is None or not self.mtp) else st.filled

    # ------------------------------------------------------------------ run
    def run(self) -> Trace:
        sc = self.sc
        trace = Trace("tensor", sc.to_dict())
        order = sorted(range(sc.batch), key=lambda i: (sc.requests[i].arrival, i))
        nxt = 0
        running: list[SeqRecord] = []
        waiting: list[SeqRecord] = []
        for t in range(sc.steps):
            while nxt < sc.batch and sc.requests[order[nxt]].arrival <= t:
                i = order[nxt]
                self.toks[i] = self.oracle.prompt(i, sc.requests[i].prompt_len)
                waiting.append(SeqRecord(i, len(self.toks[i]), None, True))
                nxt += 1
            if nxt >= sc.batch and not running and not waiting:
                break
            out = schedule(running, waiting, self.state)
            if not out.running:
                trace.add_step(step_fields(t, "idle", "cohort", None, 0, len(out.waiting), 0, 0, 0, 0.0, 0,
                                           self._tps(), None, [], None), np.zeros((0, NCOL), ROW_DTYPE))
                running, waiting = [], self._refresh(out.waiting)
                self._tick(t)
                continue
            bucket = list(out.key)
            fields, rows, committed = None, np.zeros((0, NCOL), ROW_DTYPE), 0
            if out.completion:
                pre, _ = engine_cache_instruction(sc.world, "completion", out.completion,
                                                  self.state.last_completion_ids, False,
                                                  self.state.engine_admission.granted)
                self.state.last_completion_ids = list(out.completion)
                fields, rows = self._decode(out.completion, pre.kind == "In", t, trace)
                committed += int(rows[:, 8].sum())
            if out.prompt:
                prow, perr = self._prompt(out.prompt)
                self.state.last_completion_ids = []
                committed += int(prow[:, 8].sum())
                if fields is None:
                    fields = {"phase": "prompt", "advance": "cohort", "instr": "Reset",
                              "width": sc.requests[out.prompt[0]].prompt_len, "pad": 0.0, "groups": 0,
                              "error": perr}
                    rows = prow
                elif perr is not None:
                    fields["error"] = perr if fields["error"] is None else fields["error"] + "; " + perr
            trace.add_step(step_fields(t, fields["phase"], fields["advance"], fields["instr"], out.chosen,
                                       len(out.waiting), out.n_buckets, fields["groups"], fields["width"],
                                       fields["pad"], committed, self._tps(), bucket, list(out.prompt),
                                       fields["error"]), rows)
            running = self._refresh([s for s in out.running if s.id not in self.done])
            waiting = self._refresh(out.waiting)
            self._tick(t)
        trace.finish(summarize(trace, self.tel, self.state.telemetry, self.latch, self.errors))
        trace.messages = self.messages
        return trace

    def _refresh(self, recs: list[SeqRecord]) -> list[SeqRecord]:
        """Sequences with their lengths after the step (ids and order unchanged)."""
        out = []
        for s in recs:
            c = self.caches.get(s.id)
            out.append(SeqRecord(s.id, len(self.toks[s.id]), None if c is None else c.current_seq_len,
                                 c is None))
        return out

    def _tick(self, t: int) -> None:
        if self.progress is not None:
            self.progress(t + 1, self.sc.steps)

    def _tps(self) -> float:
        tps = self.tel.total.tokens_per_step()
        return 0.0 if tps is None else tps

    # ------------------------------------------------------------------ prompt (§7.4)
    def _prompt(self, ids: list[int]):
        b = len(ids)
        plen = [self.sc.requests[i].prompt_len for i in ids]
        width = max(plen)
        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 5] = ids, np.arange(b), plen, width, plen
        rows[:, 4] = width - np.array(plen)
        rows[:, 9:12] = -1
        cache = self.new_cache(b)
        capture = MtpHiddenCapture()
        capture.arm()
        tokens = np.array([self.toks[i] for i in ids], dtype=np.int64)
        try:
            self._forward(tokens, cache, [0], None, None, capture)
        except _StepFailed as exc:
            return rows, self._fail(ids, exc)
        pieces = clone_out_cache(cache, b)
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = 0
            self.toks[i].append(self.oracle.target(i, self.toks[i]))
        rows[:, 8] = 1
        if self.mtp:
            states = [self.dmap.checkout_draft_kv(i) for i in ids]
            prime_draft_kv(states, capture.take(), [self.toks[i] for i in ids], b, self.model, self.messages)
            for i, st in zip(ids, states):
                self.dmap.checkin(i, st)
            rows[:, 12] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)
        return rows, None

    # ------------------------------------------------------------------ decode (§16)
    def _decode(self, ids: list[int], go_in: bool, t: int, trace: Trace):
        b = len(ids)
        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)
        rows[:, 0], rows[:, 1] = ids, np.arange(b)
        rows[:, 9:12] = -1
        res = {"phase": "decode", "advance": "cohort", "instr": "In" if go_in else "Nothing", "width": 0,
               "pad": 0.0, "groups": 0, "error": None}
        try:
            self._decode_inner(ids, go_in, rows, res, t, trace)
        except _StepFailed as exc:
            res["error"] = self._fail(ids, exc)
            rows[:, 6:9] = 0
            rows[:, 9:12] = -1
            rows[:, 12] = 0
        return res, rows

    def _decode_inner(self, ids, go_in, rows, res, t, trace):
        sc, w, b = self.sc, self.w, len(ids)
        if go_in:
            try:
                ci = clone_in_cache_reporting_lead([self.caches[i] for i in ids], [self.pending[i] for i in ids],
                                                   sc.xs_per_seq, self.per_seq)
            except Refusal as exc:
                kind = ERR_CAPACITY if self.per_seq and isinstance(exc, CacheRefusal) else ERR_CLONE_IN
                raise _StepFailed(kind, str(exc)) from exc
            for i in ids:
                self.pending[i] = 0
            self.state.ragged_decode_supported = ci.ragged_decode_supported
            batched, lead = ci.batched, [int(x) for x in ci.lead_pad]
            mtp_lead = lead
            assembled = True
        else:
            _, batched, lead = self.resident
            mtp_lead = [0] * b
            assembled = False
        c = batched.current_seq_len
        res["width"] = c
        la = np.array(lead, dtype=np.int64)
        rows[:, 2], rows[:, 3], rows[:, 4] = c - la, c, la
        res["pad"] = float(la.sum() / (b * c)) if c else 0.0
        psa = assembled and self.per_seq and self.mtp
        res["advance"] = "per-sequence" if psa else "cohort"
        try:
            row_lens = resolve_row_cache_lens(psa, c, mtp_lead)
        except DispatchRefusal as exc:
            raise _StepFailed(ERR_GUARD_LEFT, str(exc)) from exc
        cache_lens = row_lens if row_lens is not None else [c] * b
        tok_lens = [len(self.toks[i]) for i in ids]
        sw = plan_step_window(cache_lens, tok_lens, w)
        u = sw.uncached
        rows[:, 5] = u
        if not sw.ok:
            what = window_guard(row_lens is not None, self.kv)
            if what == "left_aligned_guard":
                raise _StepFailed(ERR_GUARD_LEFT, guard_error(what, cache_lens, tok_lens, w))
            if what == "follows_guard":
                raise _StepFailed(ERR_GUARD_FOLLOWS, guard_error(what, cache_lens, tok_lens, w))
            return self._defer(ids, batched, lead, rows, res)
        budgets = [token_budget(sc.max_seq_len, n) for n in tok_lens]
        drafts: list[list[int]] = [[] for _ in range(b)]
        states = None
        if self.mtp:
            states = [self.dmap.checkout_draft_kv(i) for i in ids]
            may = [sc.requests[i].may_draft for i in ids]
            groups = draft_groups(u, cache_lens, may, w, psa)
            res["groups"] = len(groups)
            try:
                chains = group_drafting_loop(self.model, groups, states, [self.toks[i] for i in ids], cache_lens,
                                             budgets, w, psa, self.messages)
            except Refusal as exc:
                raise _StepFailed(ERR_CHAIN, str(exc)) from exc
            for r, i in enumerate(ids):
                if chains[r]:
                    drafts[r] = self.oracle.draft(i, self.toks[i], w - u[r])
                    rows[r, 9:11] = draft_group_key(u[r], cache_lens[r], psa)
                    rows[r, 11] = chain_start_of(cache_lens[r], u[r])
        windows = []
        for r, i in enumerate(ids):
            win = self.toks[i][cache_lens[r]:] + drafts[r]
            windows.append(win + [win[-1]] * (w - len(win)))
        offsets = list(cache_lens) if row_lens is not None else [c]
        row_q0 = ragged_row_q0(offsets, sc.per_seq_kv)
        capture = MtpHiddenCapture()
        capture.arm()
        fwd = self._forward(np.array(windows, dtype=np.int64), batched, offsets, row_q0,
                            mtp_lead if row_lens is not None else None, capture)
        if self.record:
            trace.tensors.append(self._record(batched, {
                "step": t, "tokens": np.array(windows), "positions": offsets, "row_q0": row_q0, "lead": list(lead),
                "hidden": fwd.hidden.copy(), "logits": fwd.logits.copy()}))
        acc, emitted = [], []
        for r, i in enumerate(ids):
            ctx, prop = self.toks[i], drafts[r]
            targets = [self.oracle.target(i, ctx + prop[:j]) for j in range(len(prop) + 1)]
            a = budget_clamp(len(verify_proposed(prop, targets[: len(prop)]).accepted), budgets[r])
            req = sc.requests[i]
            rem = req.max_new_tokens - (len(ctx) - req.prompt_len)
            k = min(a, rem)
            out = prop[:k] + ([targets[a]] if rem > a and budgets[r] > a else [])
            acc.append(a)
            emitted.append(out)
        rows[:, 6] = [len(d) for d in drafts]
        rows[:, 7] = acc
        rows[:, 8] = [len(e) for e in emitted]
        for r, i in enumerate(ids):
            self.toks[i] += emitted[r]
        if not psa:
            plan = plan_batch_step(u, acc, w)
            if plan.n_drop > 0:
                try:
                    truncate_cache_by(batched, plan.n_drop)
                except StepRefusal as exc:
                    raise _StepFailed(ERR_XS_ROLLBACK, str(exc)) from exc
        else:
            committed = plan_per_sequence_step(u, acc, w).committed
        if self.mtp:
            extend_draft_kvs(states, capture.take(), [self.toks[i] for i in ids], b, self.model, self.messages)
            for i, st in zip(ids, states):
                self.dmap.checkin(i, st)
            stats = [from_fused_verify(len(drafts[r]), acc[r]) for r in range(b)]
            for i, s in zip(ids, stats):
                self.tel.record_step(i, s)
            self.tel.record_batch(b, stats)
        pieces = clone_out_cache(batched, b)
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = lead[r]
        self.resident = (list(ids), batched, lead)
        if psa:
            for r, i in enumerate(ids):
                self._commit(i, lead[r], cache_lens[r], committed[r], c)
        rows[:, 12] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)

    def _commit(self, i: int, lead: int, own: int, committed: int, c: int) -> None:
        """The per-sequence commit after Out (§12.2) under the strip policy (§5.5)."""
        cache = self.caches[i]
        try:
            if self.sc.strip == "eager":
                commit_per_sequence(cache, lead, own, committed)
                self.pending[i] = 0
                return
            for slot in cache.slots:
                if isinstance(slot, XsRolling):
                    slot.set_len(own + committed)
                elif self.sc.strip == "lazy":
                    slot.set_len(lead + own + committed)
                else:
                    slot.set_len(c + committed)
            if self.sc.strip == "none":
                self.pending[i] = 0
        except Refusal as exc:
            raise _StepFailed(ERR_COMMIT, str(exc)) from exc

    def _defer(self, ids, batched, lead, rows, res):
        """§16 step 4 deferral: clear the whole draft map, one plain decode step."""
        res["phase"] = "defer"
        self.dmap.clear_draft_kv()
        c = batched.current_seq_len
        offsets = [c - l for l in lead]
        tokens = np.array([[self.toks[i][-1]] for i in ids], dtype=np.int64)
        self._forward(tokens, batched, offsets, ragged_row_q0(offsets, self.sc.per_seq_kv), lead)
        for i in ids:
            self.toks[i].append(self.oracle.target(i, self.toks[i]))
        rows[:, 8] = 1
        pieces = clone_out_cache(batched, len(ids))
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = lead[r]
        self.resident = (list(ids), batched, lead)
        rows[:, 12] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)


def run(scenario, progress=None, record_tensors: bool = False) -> Trace:
    """Run a scenario (a `Scenario`, dict or path) in tensor mode; return its Trace (with
    `trace.tensors` filled when `record_tensors`, and `trace.messages` the warnings and
    failure details)."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return TensorEngine(sc, progress, record_tensors).run()
