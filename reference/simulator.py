"""Tensor-mode step simulator: the engine loop driving the tensor-side rules through a backend.

The simulator owns the control flow; every tensor-side operation is one method of a backend
(`raggedspec.reference.backend`: `NumpyBackend` = the `reference/` functions, the default;
`raggedspec.gpu.backend.TorchBackend` = the torch port; any `Backend` a caller passes). Each decode
step
runs cache-and-draft.md §16 in order, through the backend; control flow never reads a float, so
two backends take the same path on the same scenario. The step in detail, the shared choices
(`reference.policy`) and what `record_tensors=True` records are in docs/simulator.md ("Inside
the two modes").
"""

from __future__ import annotations

import numpy as np

from raggedspec.reference.acceptance import build_model, build_oracle
from raggedspec.reference.accounting import AcceptanceTelemetry, from_fused_verify
from raggedspec.reference.backend import Backend, load_backend
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import DraftKv, DraftKvMap
from raggedspec.reference.errors import CacheRefusal, DispatchRefusal, Refusal, StepRefusal
from raggedspec.reference.policy import (
    COL,
    ERR_CAPACITY,
    ERR_CHAIN,
    ERR_CLONE_IN,
    ERR_COMMIT,
    ERR_GUARD_LEFT,
    ERR_XS_ROLLBACK,
    GUARD_ERRORS,
    NCOL,
    NULL_COLS,
    ROW_DTYPE,
    advance_latch,
    fill_rows,
    guard_error,
    step_fields,
    summarize,
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
from raggedspec.reference.step import mtp_window, per_seq_advance, window_guard
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

    def _forward(
        self, tokens, cache, offsets, row_q0, lead_pad, capture=None, phase="decode", t=0, ids=()
    ):
        try:
            fwd = self.be.forward(self.model, tokens, cache, offsets, row_q0, lead_pad, capture)
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
            if not out.running:
                trace.add_step(
                    step_fields(
                        t,
                        "idle",
                        "cohort",
                        None,
                        0,
                        len(out.waiting),
                        0,
                        0,
                        0,
                        0.0,
                        0,
                        self._tps(),
                        None,
                        [],
                        None,
                    ),
                    np.zeros((0, NCOL), ROW_DTYPE),
                )
                running, waiting = [], self._refresh(out.waiting)
                self._tick(t)
                continue
            bucket = list(out.key)
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
                    fields = {
                        "phase": "prompt",
                        "advance": "cohort",
                        "instr": "Reset",
                        "width": sc.requests[out.prompt[0]].prompt_len,
                        "pad": 0.0,
                        "groups": 0,
                        "error": perr,
                    }
                    rows = prow
                elif perr is not None:
                    fields["error"] = (
                        perr if fields["error"] is None else fields["error"] + "; " + perr
                    )
            trace.add_step(
                step_fields(
                    t,
                    fields["phase"],
                    fields["advance"],
                    fields["instr"],
                    out.chosen,
                    len(out.waiting),
                    out.n_buckets,
                    fields["groups"],
                    fields["width"],
                    fields["pad"],
                    committed,
                    self._tps(),
                    bucket,
                    list(out.prompt),
                    fields["error"],
                ),
                rows,
            )
            self._record_state(t, list(out.completion) + list(out.prompt))
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
        res = {
            "phase": "decode",
            "advance": "cohort",
            "instr": "In" if go_in else "Nothing",
            "width": 0,
            "pad": 0.0,
            "groups": 0,
            "error": None,
        }
        try:
            self._decode_inner(ids, go_in, post_out, rows, res, t, trace)
        except _StepFailed as exc:
            res["error"] = self._fail(ids, exc)
            fill_rows(rows, drafted=0, accepted=0, committed=0)
            rows[:, NULL_COLS] = -1
            rows[:, COL["filled"]] = 0
        return res, rows

    def _decode_inner(self, ids, go_in, post_out, rows, res, t, trace):
        sc, w, b, be = self.sc, self.w, len(ids), self.be
        if go_in:
            try:
                ci = be.clone_in([self.caches[i] for i in ids], [self.pending[i] for i in ids],
                                 sc.xs_per_seq, self.per_seq)
            except Refusal as exc:
                kind = (
                    ERR_CAPACITY if self.per_seq and isinstance(exc, CacheRefusal) else ERR_CLONE_IN
                )
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
        c = be.cache_len(batched)
        res["width"] = c
        la = np.array(lead, dtype=np.int64)
        fill_rows(rows, own_len=c - la, width=c, lead=la)
        res["pad"] = float(la.sum() / (b * c)) if c else 0.0
        psa = per_seq_advance(assembled, post_out, self.kv)
        res["advance"] = "per-sequence" if psa else "cohort"
        try:
            row_lens = be.resolve_row_cache_lens(psa, c, mtp_lead)
        except DispatchRefusal as exc:
            raise _StepFailed(ERR_GUARD_LEFT, str(exc)) from exc
        cache_lens = row_lens if row_lens is not None else [c] * b
        tok_lens = [len(self.toks[i]) for i in ids]
        u, ok = be.plan_step_window(cache_lens, tok_lens, w)
        rows[:, COL["u"]] = u
        if not ok:
            what = window_guard(row_lens is not None, self.kv)
            if what in GUARD_ERRORS:
                raise _StepFailed(GUARD_ERRORS[what], guard_error(what, cache_lens, tok_lens, w))
            return self._defer(ids, batched, lead, rows, res, t)
        budgets = be.token_budget(sc.max_seq_len, tok_lens)
        drafts: list[list[int]] = [[] for _ in range(b)]
        states = None
        if self.mtp:
            states = [self.dmap.checkout_draft_kv(i) for i in ids]
            may = [sc.requests[i].may_draft for i in ids]
            groups = be.draft_groups(u, cache_lens, may, w, psa)
            res["groups"] = len(groups)
            try:
                chains = be.draft_chain(
                    self.model,
                    groups,
                    states,
                    [self.toks[i] for i in ids],
                    cache_lens,
                    budgets,
                    w,
                    psa,
                    self.messages,
                )
            except Refusal as exc:
                raise _StepFailed(ERR_CHAIN, str(exc)) from exc
            drew = [r for r in range(b) if chains[r]]
            if drew:
                keys = be.draft_group_keys([u[r] for r in drew], [cache_lens[r] for r in drew], psa)
                starts = be.chain_starts([cache_lens[r] for r in drew], [u[r] for r in drew])
                for r, key, start in zip(drew, keys, starts, strict=False):
                    drafts[r] = self.oracle.draft(ids[r], self.toks[ids[r]], w - u[r])
                    rows[r, [COL["group_u"], COL["group_start"]]] = key
                    rows[r, COL["chain_start"]] = start
        windows = []
        for r, i in enumerate(ids):
            win = self.toks[i][cache_lens[r]:] + drafts[r]
            windows.append(win + [win[-1]] * (w - len(win)))
        offsets = list(cache_lens) if row_lens is not None else [c]
        row_q0 = be.ragged_row_q0(offsets, sc.per_seq_kv)
        capture = MtpHiddenCapture()
        capture.arm()
        self._forward(np.array(windows, dtype=np.int64), batched, offsets, row_q0,
                      mtp_lead if row_lens is not None else None, capture, "decode", t, ids)
        proposed, targets = [], []
        for r, i in enumerate(ids):
            ctx, prop = self.toks[i], drafts[r]
            proposed.append(prop)
            targets.append([self.oracle.target(i, ctx + prop[:j]) for j in range(len(prop) + 1)])
        verified = be.verify_accept(
            proposed, [tg[: len(p)] for p, tg in zip(proposed, targets, strict=False)]
        )
        acc = be.budget_clamp(verified, budgets)
        emitted = []
        for r, i in enumerate(ids):
            prop, a, req = proposed[r], acc[r], sc.requests[i]
            rem = req.max_new_tokens - (len(self.toks[i]) - req.prompt_len)
            k = min(a, rem)
            emitted.append(prop[:k] + ([targets[r][a]] if rem > a and budgets[r] > a else []))
        rows[:, COL["drafted"]] = [len(d) for d in drafts]
        rows[:, COL["accepted"]] = acc
        rows[:, COL["committed"]] = [len(e) for e in emitted]
        for r, i in enumerate(ids):
            self.toks[i] += emitted[r]
        if not psa:
            _keep, n_drop, _next = be.plan_batch_step(u, acc, w)
            if n_drop > 0:
                try:
                    be.truncate_by(batched, n_drop)
                except StepRefusal as exc:
                    raise _StepFailed(ERR_XS_ROLLBACK, str(exc)) from exc
        else:
            committed = be.plan_per_sequence_step(u, acc, w)[0]
        if self.mtp:
            be.extend_draft_kvs(
                states, capture.take(), [self.toks[i] for i in ids], b, self.model, self.messages
            )
            for i, st in zip(ids, states, strict=False):
                self.dmap.checkin(i, st)
            stats = [from_fused_verify(len(drafts[r]), acc[r]) for r in range(b)]
            for i, s in zip(ids, stats, strict=False):
                self.tel.record_step(i, s)
            self.tel.record_batch(b, stats)
        pieces = be.clone_out(batched, b)
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = lead[r]
        self.resident = (list(ids), batched, lead)
        if psa:
            for r, i in enumerate(ids):
                self._commit(i, lead[r], cache_lens[r], committed[r], c)
        rows[:, COL["filled"]] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)

    def _commit(self, i: int, lead: int, own: int, committed: int, c: int) -> None:
        """The per-sequence commit after Out (§12.2) under the strip policy (§5.5)."""
        cache = self.caches[i]
        try:
            if self.sc.strip == "eager":
                self.be.commit_per_sequence(cache, lead, own, committed)
                self.pending[i] = 0
                return
            kv_len = lead + own + committed if self.sc.strip == "lazy" else c + committed
            self.be.set_lens(cache, kv_len, own + committed)
            if self.sc.strip == "none":
                self.pending[i] = 0
        except Refusal as exc:
            raise _StepFailed(ERR_COMMIT, str(exc)) from exc

    def _defer(self, ids, batched, lead, rows, res, t=0):
        """§16 step 4 deferral: clear the whole draft map, one plain decode step."""
        res["phase"] = "defer"
        self.dmap.clear_draft_kv()
        c = self.be.cache_len(batched)
        offsets = [c - pad for pad in lead]
        tokens = np.array([[self.toks[i][-1]] for i in ids], dtype=np.int64)
        self._forward(
            tokens,
            batched,
            offsets,
            self.be.ragged_row_q0(offsets, self.sc.per_seq_kv),
            lead,
            None,
            "defer",
            t,
            ids,
        )
        for i in ids:
            self.toks[i].append(self.oracle.target(i, self.toks[i]))
        rows[:, COL["committed"]] = 1
        pieces = self.be.clone_out(batched, len(ids))
        for r, i in enumerate(ids):
            self.caches[i] = pieces[r]
            self.pending[i] = lead[r]
        self.resident = (list(ids), batched, lead)
        rows[:, COL["filled"]] = [self._filled(i) for i in ids]
        for i in ids:
            if self._terminal(i):
                self.done.add(i)


def run(scenario, progress=None, record_tensors: bool = False, backend=None) -> Trace:
    """Run a scenario (a `Scenario`, dict or path) in tensor mode on `backend` (a `Backend`,
    or a `load_backend` name; default the NumPy reference); return its Trace (with
    `trace.tensors` / `trace.tensor_log` filled when `record_tensors`, and `trace.messages`
    the warnings and failure details)."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return TensorEngine(sc, progress, record_tensors, backend).run()
