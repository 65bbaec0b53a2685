"""Lengths-only simulator: the engine's per-step decisions on integer lengths alone.

It takes exactly the decisions of the tensor mode (`reference.simulator`), which drives the
real cache, model and draft-chain functions, but keeps only what decides control flow: per
sequence its token count, the length, capacity and pending lead of its own target cache, its
draft-KV state (length, capacity, filled, seed position, poisoned, LRU stamp); the pipeline's
resident batched cache (width, capacity, leads); the scheduler's urgency and order. Every
decode step is the step plan (`reference.plan`: `plan_step` before verify, `plan_commit`
after it), the same two functions the tensor mode calls, on the batch's arrays, plus the
mirrors of what the tensors would refuse (capacity growth, the draft-KV map, the group
chains); the only Python loops on the step path are over draft groups (at most w per step),
the plan's row rules and scheduler buckets. The trace is identical, integer for integer, to
the tensor mode's (conformance/test_lengths.py).

What it keeps per row, the spec sections it follows, the shared choices and its draft-stall
counters are in docs/simulator.md ("Inside the two modes"); the scheduler half is
`reference.lengths_scheduler`. Its benchmark (B = 1024, 10,000 steps) is
`python -m raggedspec.bench.lengths --bench` (raggedspec/bench/lengths.py).
"""

from __future__ import annotations

import numpy as np

from raggedspec.reference.acceptance import build_model, build_oracle
from raggedspec.reference.accounting import POSITION_CAP, AcceptanceTelemetry, MtpAcceptance
from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY, PLAIN_CACHE_CAPACITY
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.policy import (
    COL,
    ERR_CAPACITY,
    ERR_CHAIN,
    ERR_CLONE_IN,
    ERR_XS_ROLLBACK,
    NCOL,
    NULL_COLS,
    ROW_DTYPE,
    advance_latch,
    decode_phase,
    fill_rows,
    grown_capacity,
    idle_fields,
    phase_fields,
    prompt_phase,
    ragged_capable,
    summarize,
    with_prompt_error,
)
from raggedspec.reference.scenario import Scenario, load_scenario, model_config
from raggedspec.reference.lengths_draft import (
    STALL_INELIGIBLE,
    STALL_RAGGED,
    STALL_UNIFORM,
    DraftMirror,
)
from raggedspec.reference.lengths_scheduler import ScheduleMirror
from raggedspec.reference.scheduler_telemetry import BucketTelemetry
from raggedspec.reference.scheduler import engine_cache_instruction
from raggedspec.reference.plan import CommitPlan, StepPlan, plan_commit, plan_step
from raggedspec.reference.step import mtp_window, per_seq_advance, verify_proposed
from raggedspec.reference.trace import Trace


def _i64(values) -> np.ndarray:
    """`values` (lengths, counts, arrival steps) as an int64 array."""
    return np.asarray(values, dtype=np.int64)


def _zeros(n: int) -> np.ndarray:
    """n int64 zeros: every integer state array and per-step vector starts from these."""
    return np.zeros(n, dtype=np.int64)


# ----------------------------------------------------------------------------- the engine


class LengthsEngine(ScheduleMirror, DraftMirror):
    """The lengths-only engine; `run()` returns the Trace. State arrays are indexed by
    sequence id (the request's index in the scenario). Its scheduler half (`_schedule`) is
    `reference.lengths_scheduler.ScheduleMirror`, its draft half (the draft-KV map and the
    group drafting loop) `reference.lengths_draft.DraftMirror`."""

    def __init__(self, sc: Scenario, progress=None) -> None:
        self.sc = sc
        self.progress = progress
        self.w = mtp_window(sc.depth)
        self.mtp = sc.depth > 0
        self.max = sc.max_seq_len
        self.model = build_model(sc.acceptance, sc.seed, sc)
        self.tokens_mode = self.model.needs_tokens
        cfg = model_config(sc)
        self.oracle = build_oracle(self.model, sc.seed, cfg.vocab)
        self.has_xs = any(r > 0 for r in cfg.compress_ratios)
        self.tier_a = (
            cfg.mtp == "heads"
        )  # no MTP block: no seed is ever stashed, so no row drafts (§7.2 step 3)
        self.latch, self.kv = advance_latch(sc)
        self.per_seq = self.kv is KvAdvance.PER_SEQUENCE
        self.granted = sc.world == "WB" and self.per_seq
        self.can = ragged_capable(sc)
        n = sc.batch
        req = sc.requests
        self.P = _i64([r.prompt_len for r in req])
        self.M = _i64([r.max_new_tokens for r in req])
        self.arrival = _i64([r.arrival for r in req])
        self.may = np.array([r.may_draft for r in req])
        def z(v: int = 0) -> np.ndarray:
            return _zeros(n) + v

        self.L, self.stored, self.tcap, self.pending = z(), z(-1), z(PLAIN_CACHE_CAPACITY), z()
        self.is_prompt = np.ones(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
        self.urg, self.admitted = z(), np.zeros(n, dtype=bool)
        self.d_in, self.d_pois = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        self.d_cur, self.d_cap, self.d_filled, self.d_seed, self.d_stamp = (
            z(),
            z(DRAFT_CACHE_CAPACITY),
            z(),
            z(-1),
            z(),
        )
        self.vk = z()
        self.toks: dict[int, list[int]] = {}
        self._pending_tokens: dict[int, tuple[list[int], list[int]]] = {}
        self.clock = 0
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.last_completion: list[int] = []
        self.resident = None  # (ids tuple, C, cap, phys_lead array)
        self.ragged_supported = False
        self.floor_count = 0
        self.sched = BucketTelemetry()
        self.tel = AcceptanceTelemetry()  # filled once at the end; no step is recorded into it
        self.acc = _zeros(6)  # accepted, proposed, steps, drafted_steps, committed, batch_steps
        self.acc_at, self.reach_at = _zeros(POSITION_CAP), _zeros(POSITION_CAP)
        self.by_batch: dict[int, np.ndarray] = {}
        self.errors = 0
        self.stalls = {STALL_UNIFORM: 0, STALL_RAGGED: 0, STALL_INELIGIBLE: 0}
        self.order = np.argsort(self.arrival, kind="stable")
        self.next_arrival = 0
        self.log2 = None

    # ------------------------------------------------------------------ run
    def run(self) -> Trace:
        sc = self.sc
        trace = Trace("lengths", sc.to_dict())
        n = sc.batch
        for t in range(sc.steps):
            while self.next_arrival < n and self.arrival[self.order[self.next_arrival]] <= t:
                i = int(self.order[self.next_arrival])
                self.waiting.append(i)
                self.L[i] = self.P[i]
                if self.tokens_mode:  # at arrival, as the tensor mode asks for it
                    self.toks[i] = self.oracle.prompt(i, int(self.P[i]))
                self.next_arrival += 1
            if self.next_arrival >= n and not self.running and not self.waiting:
                break
            out = self._schedule()
            if out is None:
                trace.add_step(idle_fields(t, len(self.waiting), self._tps()),
                               np.zeros((0, NCOL), ROW_DTYPE))
            else:
                self._scheduled_step(out, t, trace)
            self._tick(t)
        self._fill_telemetry()
        trace.finish(summarize(trace, self.tel, self.sched, self.latch, self.errors))
        trace.draft_stalls = dict(self.stalls)
        return trace

    def _scheduled_step(self, out, t: int, trace: Trace) -> None:
        """One scheduled step: its decode half (completion), then its prompt half."""
        chosen, key, n_buckets = out
        bucket = self._key_tuple(key)
        comp = chosen[~self.is_prompt[chosen]]
        prom = chosen[self.is_prompt[chosen]]
        fields, committed = None, 0
        if comp.shape[0]:
            fields, rows = self._decode(comp)
            committed = int(rows[:, COL["committed"]].sum())
            self.last_completion = comp.tolist()
        if prom.shape[0]:
            prow, perr = self._prompt(prom)
            committed += int(prow[:, COL["committed"]].sum())
            self.last_completion = []
            if fields is None:
                fields, rows = prompt_phase(int(self.P[prom[0]]), perr), prow
            else:
                with_prompt_error(fields, perr)
        self.running = chosen[~self.done[chosen]].tolist()
        trace.add_step(phase_fields(t, fields, int(chosen.shape[0]), len(self.waiting), n_buckets,
                                    committed, self._tps(), bucket, prom.tolist()), rows)

    def _tick(self, t: int) -> None:
        if self.progress is not None:
            self.progress(t + 1, self.sc.steps)

    def _tps(self) -> float:
        return float(self.acc[4] / self.acc[2]) if self.acc[2] else 0.0

    def _finish(self, ids: np.ndarray) -> None:
        term = (self.L[ids] - self.P[ids] >= self.M[ids]) | (self.L[ids] >= self.max)
        self.done[ids[term]] = True

    def _fail(self, ids: np.ndarray, kind: str) -> str:
        self.done[ids] = True
        self.d_in[ids] = False
        self.errors += 1
        return kind

    # ------------------------------------------------------------------ prompt step (§7.4)
    def _prompt(self, ids: np.ndarray):
        b = ids.shape[0]
        plen = self.P[ids]
        width = int(plen.max())
        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)
        fill_rows(rows, seq=ids, row=np.arange(b), own_len=plen, width=width, u=plen)
        rows[:, COL["lead"]] = width - plen
        rows[:, NULL_COLS] = -1
        cap = int(grown_capacity(PLAIN_CACHE_CAPACITY, width))
        if width > PLAIN_CACHE_CAPACITY and cap > self.max:
            return rows, self._fail(ids, ERR_CAPACITY)
        self.is_prompt[ids] = False
        self.stored[ids], self.tcap[ids], self.pending[ids] = plen, cap, 0
        if self.tokens_mode:
            for i in ids.tolist():
                ctx = self.toks[i]
                self.toks[i] = ctx + [self.oracle.target(i, ctx)]
        self.L[ids] = plen + 1
        rows[:, COL["committed"]] = 1
        if self.mtp:
            self._checkout(ids)
            self._extend(ids, _zeros(b), width)
            self._checkin(ids)
            rows[:, COL["filled"]] = np.where(self.d_in[ids], self.d_filled[ids], 0)
        self._finish(ids)
        return rows, None

    # ------------------------------------------------------------------ decode step (§16)
    def _decode(self, ids: np.ndarray):
        """One decode step, top to bottom: assemble -> plan -> draft -> accept -> commit ->
        extend the draft KVs -> hand the rows back; each refusal fails the step."""
        b = ids.shape[0]
        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)
        fill_rows(rows, seq=ids, row=np.arange(b))
        rows[:, NULL_COLS] = -1
        res = decode_phase()
        pre, post = engine_cache_instruction(
            self.sc.world, "completion", ids.tolist(), self.last_completion, False, self.granted
        )
        res["instr"] = pre.kind if pre.kind == "In" else "Nothing"
        assembled = self._assemble(ids) if pre.kind == "In" else self.resident[1:]
        if isinstance(assembled, str):
            return self._decode_fail(res, rows, ids, assembled)
        bc, bcap, lead = assembled
        plan = self._plan(ids, bc, lead, pre.kind == "In", post.kind == "Out", rows, res)
        if plan.refusal is not None:
            return self._decode_fail(res, rows, ids, plan.refusal[0])
        if plan.guard == "defer":
            return self._defer(res, rows, ids, bc, bcap, lead)
        drafts = _zeros(b)
        if self.mtp:
            self._checkout(ids)
            if not self._draft(ids, plan, drafts, rows, res):
                return self._decode_fail(res, rows, ids, ERR_CHAIN)
        need = bc + self.w
        grown = int(grown_capacity(bcap, need))
        if (need > bcap and grown > self.max) or (
                self.has_xs and (bc - lead + self.w > self.max).any()):
            return self._decode_fail(res, rows, ids, ERR_CAPACITY)
        commit = self._commit_tokens(ids, plan, drafts, rows)
        if commit.n_drop > 0 and self.has_xs and (lead > 0).any():
            return self._decode_fail(res, rows, ids, ERR_XS_ROLLBACK)
        if self.mtp:  # extend draft KVs (§16 step 10), account (§15)
            self._extend(ids, plan.cache_lens, self.w)
            self._checkin(ids)
            self._account(b, drafts, commit.accepted)
        self._hand_back(ids, plan, commit, grown)
        rows[:, COL["filled"]] = np.where(self.d_in[ids], self.d_filled[ids], 0)  # no MTP: none in
        self._finish(ids)
        return res, rows

    def _assemble(self, ids: np.ndarray):
        """Pre-op In (clone_in): strip the pending leads and front-align the rows; returns
        (width, capacity, leads) or the refusal's kind."""
        self.stored[ids] -= self.pending[ids]
        self.tcap[ids] -= self.pending[ids]
        self.pending[ids] = 0
        own = self.stored[ids]
        c = int(own.max())
        mismatch = bool((own != own[0]).any())
        self.ragged_supported = self.can
        if self.per_seq or self.can:  # front-align (lead 0 everywhere when uniform)
            lead = c - own
            padded = np.maximum(self.tcap[ids], c)  # the longest row's own is <= its cap
            if ((lead > 0) & (padded > self.max)).any():
                # PerSequence: front_align_batch's refusal propagates; otherwise
                # front_align_would_succeed is false and ensure_uniform refuses
                return ERR_CAPACITY if self.per_seq else ERR_CLONE_IN
            self.tcap[ids] = padded
            self.stored[ids] = c
        elif mismatch:
            return ERR_CLONE_IN
        else:
            lead = _zeros(ids.shape[0])
        return c, int(self.tcap[ids].max()), lead

    def _plan(self, ids, bc: int, lead, assembled: bool, post_out: bool, rows, res) -> StepPlan:
        """The step plan (`reference.plan.plan_step`) and the rows' planned columns."""
        b = ids.shape[0]
        res["width"] = bc
        fill_rows(rows, own_len=bc - lead, width=bc, lead=lead)
        res["pad"] = float(lead.sum() / (b * bc))  # bc >= 1: a row holds at least its prompt
        # the per-row step needs the batch assembled here (In), so its leads are this step's
        psa = per_seq_advance(assembled, post_out, self.kv)
        res["advance"] = "per-sequence" if psa else "cohort"
        plan = plan_step(bc, lead, self.L[ids], per_seq=psa, advance=self.kv, w=self.w,
                         max_seq_len=self.max, per_seq_kv=self.sc.per_seq_kv,
                         may_draft=self.may[ids] if self.mtp else None)
        if plan.refusal is None or plan.guard is not None:
            rows[:, COL["u"]] = plan.u
        return plan

    def _commit_tokens(self, ids, plan: StepPlan, drafts, rows) -> CommitPlan:
        """Accept (§11.2) and the commit plan; each row's token count grows by its commit."""
        L = plan.tok_lens
        a = self._accept(ids, L, drafts)
        commit = plan_commit(plan, a, self.M[ids] - (L - self.P[ids]), self.w, self.sc.strip)
        a, e = commit.accepted, commit.committed
        if self.tokens_mode:
            for r, i in enumerate(ids.tolist()):
                prop, targets = self._pending_tokens.pop(i)
                k = min(int(a[r]), int(e[r]))
                self.toks[i] += prop[:k] + ([targets[int(a[r])]] if e[r] > k else [])
        self.L[ids] = L + e
        fill_rows(rows, drafted=drafts, accepted=a, committed=e)
        return commit

    def _hand_back(self, ids, plan: StepPlan, commit: CommitPlan, bcap: int) -> None:
        """Post-op Out (clone_out_cache), then the per-sequence commit under the strip policy."""
        lead = plan.lead
        self.stored[ids], self.tcap[ids], self.pending[ids] = commit.width_after, bcap, lead
        self.resident = (tuple(ids.tolist()), commit.width_after, bcap, lead)
        if plan.per_seq:
            self.stored[ids] = commit.kv_len
            self.pending[ids] = commit.pending
            if self.sc.strip == "eager":
                self.tcap[ids] = bcap - lead

    def _decode_fail(self, res, rows, ids, kind):
        res["error"] = self._fail(ids, kind)
        fill_rows(rows, drafted=0, accepted=0, committed=0)
        rows[:, NULL_COLS] = -1
        rows[:, COL["filled"]] = 0
        return res, rows

    def _defer(self, res, rows, ids, bc, bcap, lead):
        """§16 step 4 deferral: clear the whole draft map, one plain decode step."""
        res["phase"] = "defer"
        self.d_in[:] = False
        grown = int(grown_capacity(bcap, bc + 1))
        if (bc + 1 > bcap and grown > self.max) or (
            self.has_xs and (bc - lead + 1 > self.max).any()
        ):
            return self._decode_fail(res, rows, ids, ERR_CAPACITY)
        if self.tokens_mode:
            for i in ids.tolist():
                self.toks[i].append(self.oracle.target(i, self.toks[i]))
        self.L[ids] += 1
        rows[:, COL["committed"]] = 1
        self.stored[ids], self.tcap[ids], self.pending[ids] = bc + 1, grown, lead
        self.resident = (tuple(ids.tolist()), bc + 1, grown, lead)
        self._finish(ids)
        return res, rows

    def _accept(self, ids, L, drafts) -> np.ndarray:
        if not self.tokens_mode:
            d = drafts > 0
            a = _zeros(ids.shape[0])
            if d.any():
                a[d] = self.model.accepted(ids[d], L[d], drafts[d], self.vk[ids[d]])
                self.vk[ids[d]] += 1
            return a
        out = _zeros(ids.shape[0])
        for r, i in enumerate(ids.tolist()):  # a custom oracle is Python per row, inherently
            ctx = self.toks[i]
            prop = self.oracle.draft(i, ctx, int(drafts[r])) if drafts[r] else []
            targets = [self.oracle.target(i, ctx + prop[:j]) for j in range(len(prop) + 1)]
            out[r] = len(verify_proposed(prop, targets[: len(prop)]).accepted)
            self._pending_tokens[i] = (prop, targets)
        return out

    def _account(self, b: int, d: np.ndarray, a: np.ndarray) -> None:
        reached = np.minimum(a + 1, d)  # 0 where nothing was drafted
        # position j counts the rows whose count exceeds j: a reversed cumulative histogram
        acc_at = np.bincount(np.minimum(a, POSITION_CAP), minlength=POSITION_CAP + 1)[
            ::-1
        ].cumsum()[::-1][1:]
        reach_at = np.bincount(np.minimum(reached, POSITION_CAP), minlength=POSITION_CAP + 1)[
            ::-1
        ].cumsum()[::-1][1:]
        vals = _i64([a.sum(), d.sum(), b, (d > 0).sum(), (1 + a).sum(), 0])
        self.acc += vals
        self.acc[5] += 1
        self.acc_at += acc_at
        self.reach_at += reach_at
        entry = self.by_batch.setdefault(b, _zeros(6 + 2 * POSITION_CAP))
        entry[:6] += vals
        entry[5] += 1
        entry[6:6 + POSITION_CAP] += acc_at
        entry[6 + POSITION_CAP:] += reach_at

    def _fill_telemetry(self) -> None:
        """Build the `AcceptanceTelemetry` the marker reads from the vectorized counters."""
        def stats(v, acc_at, reach_at) -> MtpAcceptance:
            return MtpAcceptance(
                accepted=int(v[0]),
                proposed=int(v[1]),
                steps=int(v[2]),
                drafted_steps=int(v[3]),
                committed=int(v[4]),
                batch_steps=int(v[5]),
                accepted_at=[int(x) for x in acc_at],
                reached_at=[int(x) for x in reach_at],
            )

        self.tel.total = stats(self.acc, self.acc_at, self.reach_at)
        for b, e in self.by_batch.items():
            self.tel.by_batch[b] = stats(e, e[6:6 + POSITION_CAP], e[6 + POSITION_CAP:])


def run(scenario, progress=None) -> Trace:
    """Run a scenario (a `Scenario`, dict or path) in lengths-only mode; return its Trace."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return LengthsEngine(sc, progress).run()
