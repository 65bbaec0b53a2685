"""The tensor mode's recorded log and its set-up (reference/simulator.py, `record_tensors=True`;
docs/simulator.md "Inside the two modes"): every forward record is checked field by field
against facts that do not come from the log itself (the trace's rows: ids, own lengths, leads,
widths; the sequences' committed tokens; `rope_positions` = each row's position +
arange(width); the masks rebuilt from `reference.masks` at the record's geometry with
t_c = max over rows of floor((len - lead) / ratio) for a compressed layer), and every state
record against the draft-KV rules (cache-and-draft.md §7.1, §7.2, §7.4: filled = L - 1 and
seed = (L - 2, h_{L-2}) after a full extension, a poisoned state never seeds again, Tier A
never seeds, a deferral empties the map, the LRU cap) and the strip policy (§5.5, §12.2). A
backend-vs-backend comparison cannot see a recording bug (both backends share the simulator),
hence these independent checks. Also: the progress callback and the failure record of a
refused step."""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.conformance.helpers import per_sequence_example
from raggedspec.reference import masks, simulator
from raggedspec.reference.scenario import load_scenario


def per_sequence(tmp_path, strip="eager", **extra):
    """The §16 PerSequence example (A 12, B 10; A accepts 2, B 0) with compressed layers of
    ratios 2 and 4 next to a Standard one, so the masks carry compressed columns."""
    return load_scenario(per_sequence_example(tmp_path, strip=strip,
                                              model={"compress_ratios": [0, 2, 4]}, **extra))


def deferring(**extra):
    """A WA run whose late prompts make the cohort window fail: deferrals with leads, and
    per-row offsets (`row_q0`) when the per-sequence flag is requested (refused in WA, so the
    advance stays cohort)."""
    return load_scenario(dict(batch=4, prompt_len=[3, 9], max_new_tokens=25, steps=8, world="WA",
                              xs_per_seq=True, **extra))


def rebuilt_mask(width, after, row_q0, window, ratio, t_c):
    """The additive union mask at queries `after - width .. after - 1` (masks-and-scheduling
    §4-§5, §12): raw keys in the sliding window, then `t_c` compressed blocks."""
    q0 = after - width
    raw_base, keep = masks.raw_keep_span(width, window, after)
    valid = np.concatenate([masks.raw_validity(width, q0, raw_base, keep, window),
                            masks.compressed_validity(width, q0, t_c, ratio)], axis=1)
    if row_q0 is None or all(r == q0 for r in row_q0):
        return np.where(valid, 0.0, -np.inf)[None, None]
    return masks.ragged_union_mask(list(row_q0), q0, valid, raw_base, keep, ratio, t_c)


def forwards(tr):
    return [r for r in tr.tensor_log if r["phase"] != "state"]


def states(tr):
    return {r["step"]: r for r in tr.tensor_log if r["phase"] == "state"}


def check_forward(rec, step, eng):
    """One forward record against the trace step it belongs to."""
    sc, cfg = eng.sc, eng.cfg
    rows = step["rows"]
    b = len(rec["ids"])
    assert rec["step"] == step["step"]
    width = rec["tokens"].shape[1]
    if rec["phase"] == "prompt":  # its own forward, after the completion forward of the step
        assert rec["ids"] == step["prefill"]
        plen = [sc.requests[i].prompt_len for i in rec["ids"]]
        assert rec["positions"] == [0] and rec["row_q0"] is None and rec["lead"] == [0] * b
        assert width == max(plen)
        for r, i in enumerate(rec["ids"]):
            assert rec["tokens"][r].tolist() == eng.toks[i][:plen[r]]
        after = width
    else:
        assert rec["phase"] == step["phase"] and rec["ids"] == [r["seq"] for r in rows]
        own = [r["own_len"] for r in rows]
        leads = [r["lead"] for r in rows]
        # per-row offsets: the deferral, and a per-sequence step with a lead (§8.2: all-zero
        # leads resolve to the scalar dispatch at the shared offset C)
        per_row = step["advance"] == "per-sequence" and any(leads)
        ragged = rec["phase"] == "defer" or per_row
        pos = own if ragged else [step["width"]]
        assert rec["positions"] == pos
        assert rec["row_q0"] == (pos if sc.per_seq_kv else None)
        assert rec["lead"] == (leads if ragged else [0] * b)
        assert width == (1 if rec["phase"] == "defer" else sc.depth + 1)
        for r, i in enumerate(rec["ids"]):
            p = pos[r if len(pos) == b else 0]
            u = 1 if rec["phase"] == "defer" else rows[r]["u"]
            assert rec["tokens"][r, :u].tolist() == eng.toks[i][p:p + u]
        after = step["width"] + width
    assert rec["tokens"].shape == (b, width) and rec["tokens"].dtype == np.int64
    assert rec["target"]["len"] == after
    assert rec["target_k0"] is rec["target"]["kv"][0][0]
    assert rec["target_k0"].shape[:3] == (b, cfg.n_kv_heads, after)
    assert rec["hidden"].shape == (b, width, cfg.hidden)
    assert rec["logits"].shape == (b, width, cfg.vocab)
    off = np.array(rec["positions"])[:, None]
    assert np.array_equal(rec["rope_positions"],
                          np.broadcast_to(off + np.arange(width)[None, :], (b, width)))
    assert len(rec["masks"]) == len(cfg.compress_ratios)
    for ratio, got in zip(cfg.compress_ratios, rec["masks"], strict=True):
        t_c = max((after - lead) // ratio for lead in rec["lead"]) if ratio > 1 else 0
        want = rebuilt_mask(width, after, rec["row_q0"], cfg.sliding_window, ratio, t_c)
        assert got.shape == want.shape and np.array_equal(got, want), (ratio, rec["step"])


def check_log(tr, eng):
    steps = {s["step"]: s for s in tr.steps()}
    fw = forwards(tr)
    for rec in fw:
        check_forward(rec, steps[rec["step"]], eng)
    assert tr.tensors == [r for r in fw if r["phase"] == "decode"]
    scheduled = [s for s in tr.steps() if s["phase"] != "idle"]
    assert sorted(states(tr)) == [s["step"] for s in scheduled]
    for s in scheduled:
        st = states(tr)[s["step"]]
        decoded = [] if s["phase"] == "prompt" else [r["seq"] for r in s["rows"]]
        assert st["ids"] == decoded + s["prefill"]
    return fw


@pytest.mark.rule("per-step tensor hook")
def test_without_record_tensors_nothing_is_recorded(tmp_path):
    eng = simulator.TensorEngine(per_sequence(tmp_path, steps=3))
    tr = eng.run()
    assert eng.record is False
    assert tr.tensor_log == [] and tr.tensors == []


@pytest.mark.rule("per-step tensor hook")
def test_record_tensors_keeps_each_verify_forward():
    sc = load_scenario({"batch": 2, "prompt_len": 6, "max_new_tokens": 8, "steps": 4, "depth": 2})
    tr = simulator.run(sc, record_tensors=True)
    assert len(tr.tensors) == 3
    rec = tr.tensors[0]
    assert rec["tokens"].shape == (2, 3) and rec["logits"].shape[:2] == (2, 3)
    assert rec["hidden"].shape[:2] == (2, 3) and rec["target_k0"].shape[0] == 2
    assert rec["positions"] == [6]


@pytest.mark.rule("per-step tensor hook")
@pytest.mark.parametrize("strip", ["eager", "lazy"])
def test_each_forward_and_state_record_of_the_per_sequence_example(tmp_path, strip):
    """Forwards: prompt B (10), prompt A (12), then two ragged decodes at positions [12, 10]
    and [15, 11] (leads [0, 2], [0, 4]). States: each sequence's own cache holds its
    committed positions (eager: own + committed, nothing pending; lazy: the padded
    lead + own + committed, the lead pending, §5.5); its draft KV holds filled = L - 1 slots
    and seeds at L - 2 with the captured hidden there (§7.2 steps 9-13, §7.4)."""
    eng = simulator.TensorEngine(per_sequence(tmp_path, strip), record_tensors=True)
    tr = eng.run()
    fw = check_log(tr, eng)
    assert [(r["phase"], r["ids"]) for r in fw] == [
        ("prompt", [1]), ("prompt", [0]), ("decode", [0, 1]), ("decode", [0, 1])]
    assert [r["positions"] for r in fw[2:]] == [[12, 10], [15, 11]]
    assert [r["lead"] for r in fw[2:]] == [[0, 2], [0, 4]]
    by_step = {r["step"]: r for r in fw}
    for s in tr.steps():
        st, rec = states(tr)[s["step"]], by_step[s["step"]]
        for r, row in enumerate(s["rows"]):
            i = row["seq"]
            if s["phase"] == "prompt":
                length, pending, big_l, off = row["own_len"], 0, row["own_len"] + 1, 0
            else:
                big_l = row["own_len"] + row["u"] + row["committed"]
                pending = row["lead"] if strip == "lazy" else 0
                length = pending + row["own_len"] + row["committed"]
                off = rec["positions"][r]
            seq = st["seqs"][i]
            assert (seq["pending"], seq["len"]) == (pending, length)
            start = row["lead"] - pending if s["phase"] != "prompt" else 0
            batched_k = rec["target"]["kv"][0][0][r]
            assert np.array_equal(seq["kv"][0][0][0], batched_k[:, start:start + length])
            d = st["drafts"][i]
            assert (d["filled"], d["poisoned"], d["seed_pos"]) == (big_l - 1, False, big_l - 2)
            assert d["filled"] == row["filled"] and d["kv"]["len"] == d["filled"]
            assert np.array_equal(d["seed"], rec["hidden"][r, big_l - 2 - off])
    assert sorted(states(tr)[3]["seqs"]) == [0, 1]


@pytest.mark.rule("per-step tensor hook")
@pytest.mark.parametrize("per_seq_kv", [False, True])
def test_a_deferral_feeds_each_row_at_its_own_position_and_empties_the_draft_map(per_seq_kv):
    """§16 step 4: the deferral clears the whole map and runs one plain decode, one token
    per row at the row's own position `width - lead` with the batch's leads (and per-row
    offsets when the per-sequence flag is set): its state record holds no draft state, and
    its rows report filled 0."""
    extra = {"advance": "per-sequence"} if per_seq_kv else {}
    eng = simulator.TensorEngine(deferring(**extra), record_tensors=True)
    tr = eng.run()
    fw = check_log(tr, eng)
    defers = [r for r in fw if r["phase"] == "defer"]
    assert defers and any(max(r["lead"]) > 0 for r in defers)
    assert all(s["advance"] == "cohort" for s in tr.steps() if s["phase"] != "idle")
    for s in tr.steps():
        if s["phase"] == "defer":
            assert states(tr)[s["step"]]["drafts"] == {}
            assert [r["filled"] for r in s["rows"]] == [0] * len(s["rows"])
            assert sorted(states(tr)[s["step"]]["seqs"]) == sorted(r["seq"] for r in s["rows"])


@pytest.mark.rule("per-step tensor hook")
def test_the_masks_follow_the_window_and_each_layers_ratio():
    """A one-column sliding window and ratios 1 (a Standard layer: no compressed keys), 2 and
    3 on a cohort run with ragged prompts (In pads the shorter one): each mask is the union
    mask at the forward's geometry, t_c from the rows' live lengths."""
    sc = load_scenario({"requests": [{"prompt_len": 5, "max_new_tokens": 12},
                                     {"prompt_len": 7, "max_new_tokens": 12, "arrival": 1}],
                        "steps": 6, "depth": 2, "model": {"sliding_window": 1,
                                                          "compress_ratios": [1, 2, 3]}})
    eng = simulator.TensorEngine(sc, record_tensors=True)
    tr = eng.run()
    fw = check_log(tr, eng)
    assert {r["phase"] for r in fw} == {"prompt", "decode"}


@pytest.mark.rule("Tier A never drafts in the fused path")
def test_a_tier_a_draft_state_has_no_cache_and_never_seeds():
    """§7.2 step 3: without an MTP block the extension returns before the seed stash: every
    recorded state has filled 0, no seed, no draft KV, and is not poisoned."""
    eng = simulator.TensorEngine(
        load_scenario({"batch": 2, "prompt_len": 6, "max_new_tokens": 8, "steps": 3, "depth": 2,
                       "model": {"mtp": "heads"}}), record_tensors=True)
    tr = eng.run()
    check_log(tr, eng)
    for st in states(tr).values():
        assert sorted(st["drafts"]) == st["ids"] == [0, 1]
        for d in st["drafts"].values():
            assert d == {"filled": 0, "poisoned": False, "seed_pos": None, "seed": None,
                         "kv": None}


@pytest.mark.rule("prompt steps of the simulator")
@pytest.mark.parametrize("depth", [0, 1])
def test_only_a_speculating_engine_keeps_draft_states(depth):
    """Depth 0 (w = 1) is the plain decoder: no draft state is ever made and every row
    reports filled 0; depth 1 primes each prompt (filled = P, §7.4)."""
    eng = simulator.TensorEngine(load_scenario({"batch": 2, "prompt_len": 5, "max_new_tokens": 6,
                                                "steps": 3, "depth": depth}),
                                 record_tensors=True)
    tr = eng.run()
    check_log(tr, eng)
    prompt = states(tr)[0]
    if depth == 0:
        assert all(st["drafts"] == {} for st in states(tr).values())
        assert all(r["filled"] == 0 for s in tr.steps() for r in s["rows"])
    else:
        assert {i: d["filled"] for i, d in prompt["drafts"].items()} == {0: 5, 1: 5}
        assert {i: d["seed_pos"] for i, d in prompt["drafts"].items()} == {0: 4, 1: 4}


@pytest.mark.rule("draft-KV map LRU")
def test_the_draft_map_cap_of_the_scenario_evicts_the_least_recent_state():
    """max_draft_kv_seqs 1: the prompt step checks in seq 0, then seq 1: only seq 1's state
    is left, so the state record holds a draft state for seq 1 alone (both own caches)."""
    eng = simulator.TensorEngine(load_scenario({"batch": 2, "prompt_len": 5, "max_new_tokens": 6,
                                                "steps": 1, "max_draft_kv_seqs": 1}),
                                 record_tensors=True)
    tr = eng.run()
    st = states(tr)[0]
    assert st["ids"] == [0, 1] and sorted(st["seqs"]) == [0, 1] and sorted(st["drafts"]) == [1]


@pytest.mark.rule("per-step tensor hook")
def test_the_progress_callback_gets_each_finished_step_out_of_the_total():
    """One call per engine step, idle ones included, `(steps done, scenario steps)`; none
    after the loop stops early (every request finished)."""
    calls = []
    sc = load_scenario({"requests": [{"prompt_len": 4, "max_new_tokens": 2, "arrival": 2}],
                        "steps": 9, "depth": 0})
    tr = simulator.run(sc, progress=lambda done, total: calls.append((done, total)))
    phases = [s["phase"] for s in tr.steps()]
    assert phases == ["idle", "idle", "prompt", "decode"]
    assert calls == [(1, 9), (2, 9), (3, 9), (4, 9)]


@pytest.mark.rule("budget and capacity near max_seq_len")
def test_each_refused_prompt_fails_its_requests_and_counts_one_error():
    """A 520-token and a 530-token prompt under max_seq_len 600: the first append needs
    capacity 1024 (512-column blocks), refused; each step's requests fail (no own cache, no
    draft state), the error is counted and the message names the kind and the refusal."""
    sc = load_scenario({"requests": [{"prompt_len": 520, "max_new_tokens": 5},
                                     {"prompt_len": 530, "max_new_tokens": 5, "arrival": 1}],
                        "max_seq_len": 600, "steps": 4})
    eng = simulator.TensorEngine(sc, record_tensors=True)
    tr = eng.run()
    refusal = "capacity refused: kv-cache capacity 1024 would be above max_seq_len 600"
    assert tr.messages == [refusal, refusal]
    assert tr.summary["errors"] == 2 and eng.errors == 2
    assert [(s["phase"], s["error"]) for s in tr.steps()] == [("prompt", "capacity refused")] * 2
    assert [(st["ids"], st["seqs"], st["drafts"]) for st in states(tr).values()] == [
        ([0], {}, {}), ([1], {}, {})]
    assert [r["committed"] for s in tr.steps() for r in s["rows"]] == [0, 0]
    assert eng.done == {0, 1}


@pytest.mark.rule("budget and capacity near max_seq_len")
def test_a_refused_decode_drops_the_poisoned_draft_state():
    """A 506-token prompt under max_seq_len 512: priming refuses to grow the draft KV past
    its 16 columns (528 > 512), so the state is poisoned with filled 0 and its seed stashed
    at P - 1 = 505 (§7.2: the seed comes before the write); it stays so. The decode at
    C = 509 appends w = 4 columns past 512 and is refused: the request fails and its draft
    state is dropped."""
    sc = load_scenario({"requests": [{"prompt_len": 506, "max_new_tokens": 30}],
                        "max_seq_len": 512, "steps": 6, "acceptance": "all-reject"})
    eng = simulator.TensorEngine(sc, record_tensors=True)
    tr = eng.run()
    got = [(s["phase"], s["width"], s["error"]) for s in tr.steps()]
    assert got == [("prompt", 506, None), ("decode", 506, None), ("decode", 507, None),
                   ("decode", 508, None), ("decode", 509, "capacity refused")]
    for t in range(4):
        d = states(tr)[t]["drafts"][0]
        assert (d["filled"], d["poisoned"], d["seed_pos"], d["kv"]["len"]) == (0, True, 505, 0)
        assert np.array_equal(d["seed"], forwards(tr)[0]["hidden"][0, 505])
    assert states(tr)[4]["drafts"] == {} and 0 in eng.done
    refusal = "capacity refused: kv-cache capacity 1024 would be above max_seq_len 512"
    assert tr.messages[-1] == refusal
    assert tr.summary["errors"] == 1
    check_log(tr, eng)


@pytest.mark.rule("window check, the two guards and the deferral")
def test_a_guard_refusal_drops_the_failed_requests_draft_states():
    """The follows guard (WA, granted per-sequence advance; §16 step 4) refuses the step after
    the first per-sequence decode before any draft state is checked out: the requests fail
    and their draft states leave the map (their own caches stay as they were)."""
    sc = load_scenario({"batch": 4, "prompt_len": 16, "max_new_tokens": 60, "steps": 4,
                        "world": "WA", "advance": "per-sequence", "admission": "grant",
                        "xs_per_seq": True})
    eng = simulator.TensorEngine(sc, record_tensors=True)
    tr = eng.run()
    errors = [(s["step"], s["error"]) for s in tr.steps()]
    assert errors == [(0, None), (1, None), (2, "follows guard")]
    before, failed = states(tr)[1], states(tr)[2]
    assert sorted(before["drafts"]) == [0, 1, 2, 3] and failed["drafts"] == {}
    assert {i: v["len"] for i, v in failed["seqs"].items()} == {
        i: v["len"] for i, v in before["seqs"].items()}
    assert eng.dmap.entries == {} and eng.done == {0, 1, 2, 3} and tr.summary["errors"] == 1
    assert tr.messages[-1].startswith("follows guard: MTP step refused by the follows guard: ")
    check_log(tr, eng)


@pytest.mark.rule("per-step tensor hook")
def test_a_ragged_decode_row_sees_what_its_sequence_alone_would(tmp_path):
    """The per-row offsets reach the model: row B (lead 2) of the first ragged decode has the
    hidden states of B's own tokens run alone through a fresh cache (causal attention: a
    position sees only its sequence's earlier tokens)."""
    eng = simulator.TensorEngine(per_sequence(tmp_path, steps=3), record_tensors=True)
    tr = eng.run()
    rec = next(r for r in forwards(tr) if r["phase"] == "decode")
    assert rec["lead"] == [0, 2]
    for r, i in enumerate(rec["ids"]):
        own = rec["positions"][r]
        toks = np.array([eng.toks[i][:own] + rec["tokens"][r].tolist()], dtype=np.int64)
        solo = eng.model.forward(toks, eng.new_cache(1), [0], None, None)
        np.testing.assert_allclose(rec["hidden"][r], solo.hidden[0, own:], rtol=1e-9, atol=1e-9)
