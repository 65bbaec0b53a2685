"""Tensor-mode step simulator: the engine loop driving the tensor-side rules through a backend.

The simulator owns the control flow and every integer decision: each decode step is planned
by `reference.plan` (`plan_step`, then `plan_commit` after verify: the same two functions the
lengths engine runs) and its tensor work is one method of a backend per operation
(`raggedspec.reference.backend`: `NumpyBackend` = the `reference/` functions, the default;
`raggedspec.gpu.backend.TorchBackend` = the torch port; any `Backend` a caller passes), which
gets the plan once (`upload_plan`). A step reads plan -> draft -> verify -> accept -> commit ->
extend the draft KVs (cache-and-draft.md §16); control flow never reads a float, so two
backends take the same path on the same scenario. The step in detail, the shared choices
(`reference.policy`) and what `record_tensors=True` records are in docs/simulator.md ("Inside
the two modes").
"""

from __future__ import annotations

import numpy as np

from raggedspec.reference.acceptance import build_model, build_oracle
from raggedspec.reference.accounting import AcceptanceTelemetry, from_fused_verify
from raggedspec.reference.backend import Backend, load_backend
from raggedspec.reference import dispatch
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import DraftKv, DraftKvMap
from raggedspec.reference.errors import CacheRefusal, Refusal, StepRefusal
from raggedspec.reference.plan import CommitPlan, StepPlan, defer_offsets, plan_commit, plan_step
from raggedspec.reference.policy import (
    COL,
    ERR_CAPACITY,
    ERR_CHAIN,
    ERR_CLONE_IN,
    ERR_COMMIT,
    ERR_XS_ROLLBACK,
    NCOL,
    NULL_COLS,
    ROW_DTYPE,
    advance_latch,
    decode_phase,
    fill_rows,
    idle_fields,
    phase_fields,
    prompt_phase,
    summarize,
    with_prompt_error,
)
from raggedspec.reference.scenario import Scenario, load_scenario, model_config
from raggedspec.reference.scheduler import (
    PrefillFloor,
    RaggedAdmission,
    SchedulerState,
    SeqRecord,
    engine_cache_instruction,
    install_admission,
    schedule,
)
from raggedspec.reference.step import mtp_window, per_seq_advance, verify_proposed
from raggedspec.reference.trace import Trace


class _StepFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class SizedDraftKvMap(DraftKvMap):
    """`DraftKvMap` with the LRU capacity of the scenario (`max_draft_kv_seqs`; arc: 64;
    None = unbounded) whose fresh states get their draft KV from the backend."""

    def __init__(self, backend: Backend, model, cap: int | None) -> None:
        super().__init__(getattr(model, "mtp", None))
        self.backend, self.model, self.cap = backend, model, cap

    def checkout_draft_kv(self, seq_id) -> DraftKv:
        if seq_id in self.entries:
            return self.entries.pop(seq_id)
        return DraftKv(cache=self.backend.new_draft_cache(self.model))

    def checkin(self, seq_id, state) -> None:
        self._clock += 1
        state.last_used = self._clock
        self.entries[seq_id] = state
        while self.cap is not None and len(self.entries) > self.cap:
            oldest = min(self.entries, key=lambda k: self.entries[k].last_used)
            del self.entries[oldest]


class TensorEngine:
    """The tensor-mode engine (module docstring); `run()` returns the Trace. `backend` is a
    `Backend` or a name for `load_backend` (default: the NumPy reference)."""

    def __init__(
        self, sc: Scenario, progress=None, record_tensors: bool = False, backend=None
    ) -> None:
        self.sc, self.progress, self.record = sc, progress, record_tensors
        self.be = load_backend(backend)
        self.w = mtp_window(sc.depth)
        self.mtp = sc.depth > 0
        self.cfg = model_config(sc)
        self.model = self.be.build_model(self.cfg)
        self.oracle = build_oracle(build_model(sc.acceptance, sc.seed, sc), sc.seed, self.cfg.vocab)
        self.latch, kv = advance_latch(sc)
        self.kv = kv if self.mtp else KvAdvance.COHORT
        self.per_seq = self.kv is KvAdvance.PER_SEQUENCE
        self.state = SchedulerState(
            world=sc.world,
            max_seqs=sc.max_seqs or (1 << 30),
            prefill_cap=sc.prefill_max_seqs,
            floor=PrefillFloor(sc.prefill_floor),
        )
        granted = sc.world == "WB" and self.per_seq
        install_admission(
            self.state,
            RaggedAdmission.decide(None if granted else "per-sequence advance not granted"),
        )
        self.dmap = SizedDraftKvMap(self.be, self.model, sc.max_draft_kv_seqs)
        self.tel = AcceptanceTelemetry(logging_enabled=False)
        self.caches: dict = {}
        self.pending: dict[int, int] = {}
        self.toks: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.resident = None  # (ids, batched cache, phys leads)
        self.errors = 0
        self.messages: list[str] = []
        self.trace: Trace | None = None

    # ------------------------------------------------------------------ helpers
    def new_cache(self, batch: int):
        """The V4-shaped target cache: K/V slots, then one XsRolling slot per compressed layer."""
        return self.be.new_target_cache(self.cfg, self.sc.max_seq_len, batch)

    def _forward(self, tokens, cache, offsets, row_q0, lead_pad, capture=None, phase="decode",
                 t=0, ids=(), device_plan=None):
        try:
            fwd = self.be.forward(self.model, tokens, cache, offsets, row_q0, lead_pad, capture,
                                  plan=device_plan)
            self.be.xs_append(cache, fwd.hidden)
        except Refusal as exc:
            raise _StepFailed(ERR_CAPACITY, str(exc)) from exc
        if self.record:
            self._record_forward(phase, t, ids, tokens, cache, offsets, row_q0, lead_pad, fwd)
        return fwd

    # ------------------------------------------------------------------ recording (record_tensors)
    def _record_forward(self, phase, t, ids, tokens, cache, offsets, row_q0, lead_pad, fwd) -> None:
        be, cfg = self.be, self.cfg
        b, width = tokens.shape
        after = be.cache_len(cache)
        masks = []
        for ratio in cfg.compress_ratios:
            t_c = 0
            if ratio > 1:  # compressed keys (start-anchored): max over rows of floor(live / ratio)
                leads = [0] * b if lead_pad is None else list(lead_pad)
                t_c = max((after - lead) // ratio for lead in leads)
            masks.append(be.to_numpy(be.union_mask(width, after, row_q0, max(cfg.sliding_window, 1),
                                                   ratio, t_c)))
        target = be.materialize(cache)
        rec = {
            "step": t,
            "phase": phase,
            "ids": list(ids),
            "tokens": np.array(tokens),
            "positions": list(offsets),
            "row_q0": None if row_q0 is None else list(row_q0),
            "lead": [0] * b if lead_pad is None else list(lead_pad),
            "rope_positions": be.rope_positions(offsets, b, width),
            "masks": masks,
            "hidden": be.to_numpy(fwd.hidden),
            "logits": be.to_numpy(fwd.logits),
            "target": target,
            "target_k0": target["kv"][0][0],
        }
        self.trace.tensor_log.append(rec)
        if phase == "decode":
            self.trace.tensors.append(rec)

    def _record_state(self, t: int, ids) -> None:
        """End of a scheduled step: each sequence's own cache and draft state."""
        if not self.record:
            return
        be = self.be
        seqs, drafts = {}, {}
        for i in ids:
            if i in self.caches:
                seqs[i] = {"pending": self.pending.get(i, 0), **be.materialize(self.caches[i])}
            st = self.dmap.entries.get(i)
            if st is not None:
                drafts[i] = {"filled": st.filled, "poisoned": st.poisoned,
                             "seed_pos": None if st.seed is None else st.seed[0],
                             "seed": None if st.seed is None else be.to_numpy(st.seed[1]),
                             "kv": None if st.cache is None else be.materialize(st.cache)}
        self.trace.tensor_log.append({"step": t, "phase": "state", "ids": list(ids), "seqs": seqs,
                                      "drafts": drafts})

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
        trace.tensor_log = []
        self.trace = trace
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
            if out.running:
                self._scheduled_step(out, t, trace)
            else:
                trace.add_step(idle_fields(t, len(out.waiting), self._tps()),
                               np.zeros((0, NCOL), ROW_DTYPE))
            running = self._refresh([s for s in out.running if s.id not in self.done])
            waiting = self._refresh(out.waiting)
            self._tick(t)
        trace.finish(summarize(trace, self.tel, self.state.telemetry, self.latch, self.errors))
        trace.messages = self.messages
        return trace

    def _scheduled_step(self, out, t: int, trace: Trace) -> None:
        """One scheduled step: its decode half (completion), then its prompt half."""
        sc = self.sc
        fields, rows, committed = None, np.zeros((0, NCOL), ROW_DTYPE), 0
        if out.completion:
            pre, post = engine_cache_instruction(sc.world, "completion", out.completion,
                                                 self.state.last_completion_ids, False,
                                                 self.state.engine_admission.granted)
            self.state.last_completion_ids = list(out.completion)
            fields, rows = self._decode(
                out.completion, pre.kind == "In", post.kind == "Out", t, trace
            )
            committed += int(rows[:, COL["committed"]].sum())
        if out.prompt:
            prow, perr = self._prompt(out.prompt, t)
            self.state.last_completion_ids = []
            committed += int(prow[:, COL["committed"]].sum())
            if fields is None:
                fields, rows = prompt_phase(sc.requests[out.prompt[0]].prompt_len, perr), prow
            else:
                with_prompt_error(fields, perr)
        trace.add_step(phase_fields(t, fields, out.chosen, len(out.waiting), out.n_buckets,
                                    committed, self._tps(), list(out.key), list(out.prompt)),
                       rows)
        self._record_state(t, list(out.completion) + list(out.prompt))

    def _refresh(self, recs: list[SeqRecord]) -> list[SeqRecord]:
        """Sequences with their lengths after the step (ids and order unchanged)."""
        out = []
        for s in recs:
            c = self.caches.get(s.id)
            out.append(
                SeqRecord(
                    s.id,
                    len(self.toks[s.id]),
                    None if c is None else self.be.cache_len(c),
                    c is None,
                )
            )
        return out

    def _tick(self, t: int) -> None:
        if self.progress is not None:
            self.progress(t + 1, self.sc.steps)

    def _tps(self) -> float:
        tps = self.tel.total.tokens_per_step()
        return 0.0 if tps is None else tps

    # ------------------------------------------------------------------ prompt (§7.4)
    def _prompt(self, ids: list[int], t: int = 0):
        b = len(ids)
        plen = [self.sc.requests[i].prompt_len for i in ids]
        width = max(plen)
        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)
        fill_rows(rows, seq=ids, row=np.arange(b), own_len=plen, width=width, u=plen)
        rows[:, COL["lead"]] = width - np.array(plen)
        rows[:, NULL_COLS] = -1
        cache = self.new_cache(b)
        capture = MtpHiddenCapture()
        capture.arm()
        tokens = np.array([self.toks[i] for i in ids], dtype=np.int64)
        try:
            self._forward(tokens, cache, [0], None, None, capture, "prompt", t, ids)
        except _StepFailed as exc:
            return rows, self._fail(ids, exc)
        pieces = self.be.clone_out(cache, b)
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = 0
            self.toks[i].append(self.oracle.target(i, self.toks[i]))
        rows[:, COL["committed"]] = 1
        if self.mtp:
            states = [self.dmap.checkout_draft_kv(i) for i in ids]
            self.be.prime_draft_kv(
                states, capture.take(), [self.toks[i] for i in ids], b, self.model, self.messages
            )
            for i, st in zip(ids, states, strict=False):
                self.dmap.checkin(i, st)
            rows[:, COL["filled"]] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)
        return rows, None

    # ------------------------------------------------------------------ decode (§16)
    def _decode(self, ids: list[int], go_in: bool, post_out: bool, t: int, trace: Trace):
        b = len(ids)
        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)
        fill_rows(rows, seq=ids, row=np.arange(b))
        rows[:, NULL_COLS] = -1
        res = decode_phase("In" if go_in else "Nothing")
        try:
            self._decode_inner(ids, go_in, post_out, rows, res, t)
        except _StepFailed as exc:
            res["error"] = self._fail(ids, exc)
            fill_rows(rows, drafted=0, accepted=0, committed=0)
            rows[:, NULL_COLS] = -1
            rows[:, COL["filled"]] = 0
        return res, rows

    def _decode_inner(self, ids, go_in, post_out, rows, res, t):
        """One decode step, top to bottom: plan -> draft -> verify -> accept -> commit ->
        extend the draft KVs -> hand the rows back."""
        batched, lead, assembled = self._assemble(ids, go_in)
        plan = self._plan(ids, batched, lead, assembled, post_out, rows, res)
        if plan.guard == "defer":
            return self._defer(ids, batched, plan, rows, res, t)
        device_plan = self.be.upload_plan(plan)
        drafts, states = self._draft(ids, plan, rows, res)
        capture, targets = self._verify(ids, batched, plan, device_plan, drafts, t)
        commit = self._accept(ids, plan, drafts, targets, rows)
        self._advance(batched, commit)
        if self.mtp:
            self._extend(ids, states, capture, drafts, commit)
        self._hand_back(ids, batched, plan.lead.tolist())
        if plan.per_seq:
            for r, i in enumerate(ids):
                self._commit(i, commit, r)
        self._finish_rows(ids, rows)

    def _assemble(self, ids, go_in: bool):
        """Pre-op In: clone the rows' caches into one batch (their leads returned); Nothing:
        the resident batch. Returns (batched cache, leads, assembled here)."""
        if not go_in:
            _, batched, lead = self.resident
            return batched, lead, False
        try:
            ci = self.be.clone_in([self.caches[i] for i in ids], [self.pending[i] for i in ids],
                                  self.sc.xs_per_seq, self.per_seq)
        except Refusal as exc:
            kind = ERR_CAPACITY if self.per_seq and isinstance(exc, CacheRefusal) else ERR_CLONE_IN
            raise _StepFailed(kind, str(exc)) from exc
        for i in ids:
            self.pending[i] = 0
        self.state.ragged_decode_supported = ci.ragged_decode_supported
        return ci.batched, [int(x) for x in ci.lead_pad], True

    def _plan(self, ids, batched, lead, assembled, post_out, rows, res) -> StepPlan:
        """The step plan (`reference.plan.plan_step`) and the rows' planned columns; a
        refused plan fails the step."""
        sc, b = self.sc, len(ids)
        c = self.be.cache_len(batched)
        res["width"] = c
        la = np.array(lead, dtype=np.int64)
        fill_rows(rows, own_len=c - la, width=c, lead=la)
        res["pad"] = float(la.sum() / (b * c)) if c else 0.0
        psa = per_seq_advance(assembled, post_out, self.kv)
        res["advance"] = "per-sequence" if psa else "cohort"
        plan = plan_step(c, la, [len(self.toks[i]) for i in ids], per_seq=psa, advance=self.kv,
                         w=self.w, max_seq_len=sc.max_seq_len, per_seq_kv=sc.per_seq_kv,
                         may_draft=[sc.requests[i].may_draft for i in ids] if self.mtp else None)
        if plan.refusal is not None and plan.guard is None:  # refused before the window
            raise _StepFailed(*plan.refusal)
        rows[:, COL["u"]] = plan.u
        if plan.refusal is not None:
            raise _StepFailed(*plan.refusal)
        return plan

    def _draft(self, ids, plan: StepPlan, rows, res):
        """The draft chains of the plan's groups (§9.3) and each drafting row's proposal."""
        drafts: list[list[int]] = [[] for _ in ids]
        if not self.mtp:
            return drafts, None
        states = [self.dmap.checkout_draft_kv(i) for i in ids]
        res["groups"] = len(plan.groups)
        try:
            chains = self.be.draft_chain(self.model, plan.groups, states,
                                         [self.toks[i] for i in ids], plan.cache_lens.tolist(),
                                         plan.budgets.tolist(), self.w, plan.per_seq,
                                         self.messages)
        except Refusal as exc:
            raise _StepFailed(ERR_CHAIN, str(exc)) from exc
        for r, i in enumerate(ids):
            if chains[r]:
                drafts[r] = self.oracle.draft(i, self.toks[i], self.w - int(plan.u[r]))
                rows[r, [COL["group_u"], COL["group_start"]]] = plan.group_key[r]
                rows[r, COL["chain_start"]] = plan.chain_start[r]
        return drafts, states

    def _verify(self, ids, batched, plan: StepPlan, device_plan, drafts, t: int):
        """The verify forward over each row's window (its uncached tail, its drafts, padded
        to w), then the target's token at each draft position."""
        windows = []
        for r, i in enumerate(ids):
            win = self.toks[i][int(plan.cache_lens[r]):] + drafts[r]
            windows.append(win + [win[-1]] * (self.w - len(win)))
        capture = MtpHiddenCapture()
        capture.arm()
        row_q0 = None if plan.row_q0 is None else plan.row_q0.tolist()
        lead = None if plan.fwd_lead is None else plan.fwd_lead.tolist()
        self._forward(np.array(windows, dtype=np.int64), batched, plan.offsets.tolist(), row_q0,
                      lead, capture, "decode", t, ids, device_plan)
        targets = [[self.oracle.target(i, self.toks[i] + drafts[r][:j])
                    for j in range(len(drafts[r]) + 1)] for r, i in enumerate(ids)]
        return capture, targets

    def _accept(self, ids, plan: StepPlan, drafts, targets, rows) -> CommitPlan:
        """Greedy verify (§11.1), then the commit plan (`plan_commit`); each row's tokens
        grow by its accepted drafts and the bonus or correction."""
        verified = [len(verify_proposed(p, tg[: len(p)]).accepted)
                    for p, tg in zip(drafts, targets, strict=False)]
        reqs = [self.sc.requests[i] for i in ids]
        remaining = [q.max_new_tokens - (len(self.toks[i]) - q.prompt_len)
                     for i, q in zip(ids, reqs, strict=False)]
        commit = plan_commit(plan, verified, remaining, self.w, self.sc.strip)
        rows[:, COL["drafted"]] = [len(d) for d in drafts]
        rows[:, COL["accepted"]] = commit.accepted
        rows[:, COL["committed"]] = commit.committed
        for r, i in enumerate(ids):
            a, e = int(commit.accepted[r]), int(commit.committed[r])
            k = min(a, e)
            self.toks[i] += drafts[r][:k] + ([targets[r][a]] if e > k else [])
        return commit

    def _advance(self, batched, commit: CommitPlan) -> None:
        """The cohort rollback (§12.3) of the plan's `n_drop` columns."""
        if commit.n_drop > 0:
            try:
                self.be.truncate_by(batched, commit.n_drop)
            except StepRefusal as exc:
                raise _StepFailed(ERR_XS_ROLLBACK, str(exc)) from exc

    def _extend(self, ids, states, capture, drafts, commit: CommitPlan) -> None:
        """Extend the draft KVs from the verify forward's hidden (§16 step 10), check them
        back in, and count the step's acceptance (§15)."""
        b = len(ids)
        self.be.extend_draft_kvs(states, capture.take(), [self.toks[i] for i in ids], b,
                                 self.model, self.messages)
        for i, st in zip(ids, states, strict=False):
            self.dmap.checkin(i, st)
        stats = [from_fused_verify(len(drafts[r]), int(commit.accepted[r])) for r in range(b)]
        for i, s in zip(ids, stats, strict=False):
            self.tel.record_step(i, s)
        self.tel.record_batch(b, stats)

    def _hand_back(self, ids, batched, lead: list[int]) -> None:
        """Post-op Out: each row gets its own copy of the batch, its lead pending."""
        pieces = self.be.clone_out(batched, len(ids))
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = lead[r]
        self.resident = (list(ids), batched, lead)

    def _finish_rows(self, ids, rows) -> None:
        rows[:, COL["filled"]] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)

    def _commit(self, i: int, commit: CommitPlan, r: int) -> None:
        """The per-sequence commit after Out (§12.2) under the strip policy (§5.5): the
        plan's strip lead and slot lengths for row r."""
        try:
            self.be.commit(self.caches[i], int(commit.strip_lead[r]), int(commit.kv_len[r]),
                           int(commit.xs_len[r]))
        except Refusal as exc:
            raise _StepFailed(ERR_COMMIT, str(exc)) from exc
        self.pending[i] = int(commit.pending[r])

    def _defer(self, ids, batched, plan: StepPlan, rows, res, t=0):
        """§16 step 4 deferral: clear the whole draft map, one plain decode step."""
        res["phase"] = "defer"
        self.dmap.clear_draft_kv()
        offsets = defer_offsets(plan).tolist()
        tokens = np.array([[self.toks[i][-1]] for i in ids], dtype=np.int64)
        row_q0 = dispatch.ragged_row_q0(offsets, self.sc.per_seq_kv)
        self._forward(tokens, batched, offsets, row_q0, plan.lead.tolist(), None, "defer", t, ids)
        for i in ids:
            self.toks[i].append(self.oracle.target(i, self.toks[i]))
        rows[:, COL["committed"]] = 1
        self._hand_back(ids, batched, plan.lead.tolist())
        self._finish_rows(ids, rows)

def run(scenario, progress=None, record_tensors: bool = False, backend=None) -> Trace:
    """Run a scenario (a `Scenario`, dict or path) in tensor mode on `backend` (a `Backend`,
    or a `load_backend` name; default the NumPy reference); return its Trace (with
    `trace.tensors` / `trace.tensor_log` filled when `record_tensors`, and `trace.messages`
    the warnings and failure details)."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return TensorEngine(sc, progress, record_tensors, backend).run()
