"""The step simulator's flow (reference/simulator.py, the tensor mode; several cases run the
lengths mode too, which takes the same decisions): the spec's worked examples replayed end to
end (cache-and-draft.md §16), the refusal chain and what it grants (§13), the engine worlds
(masks-and-scheduling.md §18, §20), the scheduler loop's idle and mixed steps, prompt priming
(§7.4), the budget and capacity near `max_seq_len` (§3, §11.2), the sized draft-KV map
(`SizedDraftKvMap`, §7.1), the engine's set-up from its scenario and backend, and the §17.2
mutations of the step arithmetic that a run must expose. The step logic against a spying
backend (failures, strip policies, guards, deferrals) is in test_simulator_steps.py, the
`record_tensors` log in test_simulator_log.py.

Expected numbers come from the spec; the acceptance file pins each row's accept count so a
run reaches exactly the spec's state.
"""

import pytest

from raggedspec.conformance.helpers import (
    GRANTED,
    accept_file,
    cohort_example,
    normalized_lines,
    per_sequence_example,
)
from raggedspec.reference import lengths, policy, simulator
from raggedspec.reference import step as step_mod
from raggedspec.reference.acceptance import AllAccept, ModelOracle
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.draft import DraftKv
from raggedspec.reference.errors import ScenarioError
from raggedspec.reference.model import ModelConfig, TinyModel
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.scheduler import PrefillFloor, RaggedAdmission
from raggedspec.reference.simulator import SizedDraftKvMap, _StepFailed
from raggedspec.reference.step import verify_proposed, window_verify_row


# ----------------------------------------------------------------------------- §16 worked examples


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
@pytest.mark.parametrize("mode", [lengths, simulator])
def test_the_cohort_example_w4_c10(tmp_path, mode):
    """§16 cohort example: A L=11 (u=1) drafts 3, B L=12 (u=2) drafts 2; groups (1,9)=[A],
    (2,10)=[B]; A accepts 3, B 0 -> keep 2, n_drop 2, cache 12; A L=15 u'=3, B L=13 u'=1."""
    st = list(mode.run(cohort_example(tmp_path)).steps())
    assert [s["phase"] for s in st] == ["prompt", "decode", "decode", "decode"]
    ex, nxt = st[2], st[3]
    assert ex["width"] == 10 and ex["advance"] == "cohort"
    a, b = ex["rows"]
    assert (a["seq"], a["u"], a["drafted"], a["group"], a["chain_start"]) == (0, 1, 3, [1, 9], 9)
    assert (b["seq"], b["u"], b["drafted"], b["group"], b["chain_start"]) == (1, 2, 2, [2, 10], 10)
    assert (a["accepted"], b["accepted"]) == (3, 0) and ex["groups"] == 2
    assert (a["committed"], b["committed"]) == (4, 1)  # 3 drafts + bonus; the correction
    assert nxt["width"] == 12  # keep = min(1+3, 2+0) = 2: C + keep
    assert [r["u"] for r in nxt["rows"]] == [3, 1]  # L 15 - 12, L 13 - 12
    assert nxt["cache_instruction"] == "Nothing"



@pytest.mark.rule("PerSequence example and the per-sequence commit")
@pytest.mark.parametrize("mode", [lengths, simulator])
def test_the_per_sequence_example(tmp_path, mode):
    """§16 PerSequence example: own KV A 12, B 10 -> lead_pad [0,2], cache_lens [12,10]; one
    group (1,0), chain starts [11,9]; A accepts 2, B 0 -> committed [3,1]; set_len A 15,
    B 11; draft filled [15,11]."""
    st = list(mode.run(per_sequence_example(tmp_path)).steps())
    ex = next(s for s in st if s["phase"] == "decode")
    assert ex["advance"] == "per-sequence" and ex["cache_instruction"] == "In" and ex["width"] == 12
    a, b = ex["rows"]
    assert [a["seq"], b["seq"]] == [0, 1]
    assert [a["lead"], b["lead"]] == [0, 2]
    assert [a["own_len"], b["own_len"]] == [12, 10]
    assert [a["u"], b["u"]] == [1, 1]
    assert a["group"] == b["group"] == [1, 0] and ex["groups"] == 1
    assert [a["chain_start"], b["chain_start"]] == [11, 9]
    assert [a["accepted"], b["accepted"]] == [2, 0]
    assert [a["committed"], b["committed"]] == [3, 1]
    assert [a["filled"], b["filled"]] == [15, 11]
    nxt = st[st.index(ex) + 1]
    assert [r["own_len"] for r in nxt["rows"]] == [15, 11]  # the per-sequence set_len
    assert [r["lead"] for r in nxt["rows"]] == [0, 4] and nxt["width"] == 15



@pytest.mark.rule("PerSequence example and the per-sequence commit")
def test_the_per_sequence_example_reads_lengths_back_off_the_caches(tmp_path):
    """Tensor mode: after the example step the sequences' own caches hold 15 and 11
    positions (eager strip + set_len, §12.2) and the draft KVs hold 15 and 11 entries."""
    sc = load_scenario(per_sequence_example(tmp_path, steps=3))
    eng = simulator.TensorEngine(sc)
    eng.run()
    assert [eng.caches[i].current_seq_len for i in (0, 1)] == [15, 11]
    assert [eng.caches[i].slots[0].k.current_data().shape[2] for i in (0, 1)] == [15, 11]
    assert [eng.dmap.entries[i].filled for i in (0, 1)] == [15, 11]
    assert [eng.dmap.entries[i].seed[0] for i in (0, 1)] == [14, 10]  # = the next chain starts
    assert [eng.dmap.entries[i].cache.current_seq_len for i in (0, 1)] == [15, 11]



# ------------------------------------------------------------------------- the refusal chain (§13)


@pytest.mark.rule("advance request vs flags and the refusal chain")
@pytest.mark.parametrize("extra, words, unwanted", [
    ({}, ["cannot honour it", "slot", "XsRolling"], []),
    ({"xs_per_seq": True}, ["cannot honour it", "cache_bucket_len", "bucket"],
     ["XsRolling", "forward_step", "cache_len ="]),
    ({"xs_per_seq": True, "admission": "grant", "model": {"compress_ratios": [0, 0]}},
     ["cannot honour it", "XsRolling", "dead"], []),
])
def test_a_refused_per_sequence_request_runs_cohort_and_names_the_check(extra, words, unwanted):
    sc = load_scenario({"batch": 3, "prompt_len": [5, 7], "max_new_tokens": 12, "steps": 12,
                        "advance": "per-sequence", **extra})
    tr = lengths.run(sc)
    refusal = tr.summary["refusal"]
    assert refusal is not None
    assert all(w in refusal for w in words), refusal
    assert not any(w in refusal for w in unwanted), refusal
    assert {s["advance"] for s in tr.steps()} == {"cohort"}
    assert normalized_lines(tr) == normalized_lines(simulator.run(sc))


@pytest.mark.rule(
    "advance request vs flags and the refusal chain",
    "scheduler worlds, bucket selection, engine cache instruction",
)
def test_every_capability_holding_grants_per_sequence_advance():
    sc = load_scenario(
        {
            "batch": 3,
            "prompt_len": 6,
            "max_new_tokens": 12,
            "steps": 8,
            "advance": "per-sequence",
            "xs_per_seq": True,
            "admission": "grant",
            "world": "WB",
        }
    )
    tr = lengths.run(sc)
    assert tr.summary["refusal"] is None
    decodes = [s for s in tr.steps() if s["phase"] == "decode"]
    assert decodes and all(s["advance"] == "per-sequence" for s in decodes)
    assert all(s["cache_instruction"] == "In" for s in decodes)  # WB: In every step (§20.3)


@pytest.mark.rule("advance request vs flags and the refusal chain")
@pytest.mark.parametrize("ratios, xs_slots, ragged", [
    ([0, 0], [], True),            # no compressed layer: Normal slots only, always ragged
    ([0, 1], [1], False),          # ratio 1 is still a compressed (XsRolling) layer
    ([0, 4, 128], [4, 128], False),
])
def test_the_target_skeleton_has_one_kv_slot_per_layer_and_one_xs_slot_per_compressed_layer(
        ratios, xs_slots, ragged):
    data = dict(batch=2, prompt_len=4, max_new_tokens=4, steps=2, max_seq_len=2048,
                model={"compress_ratios": ratios})
    sc = load_scenario(data)
    slots = policy.target_cache_skeleton(sc).slots
    kinds = [type(s).__name__ for s in slots]
    assert kinds == ["KvCache"] * len(ratios) + ["XsRolling"] * len(xs_slots)
    assert [(s.ratio, s.max_seq_len) for s in slots[len(ratios):]] == [
        (r, 2048) for r in xs_slots]
    assert policy.ragged_capable(sc) is ragged
    assert policy.ragged_capable(load_scenario(dict(data, xs_per_seq=True))) is True


@pytest.mark.rule("window check, the two guards and the deferral")
def test_each_guard_failure_text_names_its_guard_and_the_rows_lengths():
    left = policy.guard_error("left_aligned_guard", [10, 7], [2, 9], 4)
    assert "left-aligned guard" in left and "follows" not in left
    assert "cache_lens [10, 7] and token lengths [2, 9]" in left and "[1, 4]" in left
    follows = policy.guard_error("follows_guard", [10, 7], [2, 9], 4)
    assert "follows guard" in follows and "left-aligned" not in follows
    assert "cache_lens [10, 7], token lengths [2, 9], w 4" in follows


# -------------------------------------------------------- worlds and the scheduler loop (§18, §20)


@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_granted_per_sequence_advance_in_w0_shatters_the_batch():
    """Site 2 of §13: W0 buckets by cache_bucket_len, so ragged commits split the cohort."""
    tr = lengths.run(load_scenario({**GRANTED, "world": "W0", "batch": 8, "prompt_len": 16,
                                    "max_new_tokens": 60, "steps": 30, "max_draft_kv_seqs": None}))
    st = [s for s in tr.steps() if s["phase"] == "decode"]
    assert max(s["buckets"] for s in st) > 1
    assert min(s["running"] for s in st) < 8
    assert "shattered=0 " not in tr.markers()[1]



@pytest.mark.rule("window check, the two guards and the deferral")
def test_granted_per_sequence_advance_in_wa_trips_the_follows_guard():
    """Site 1 of §13: WA keeps the decode cohort in one bucket, the engine then issues
    Nothing, and a PerSequence step that did not assemble the batch is refused."""
    tr = lengths.run(load_scenario({**GRANTED, "world": "WA", "batch": 4, "prompt_len": 16,
                                    "max_new_tokens": 60, "steps": 10}))
    st = [s for s in tr.steps() if s["phase"] == "decode"]
    assert st[0]["cache_instruction"] == "In" and st[0]["error"] is None
    assert st[1]["cache_instruction"] == "Nothing" and st[1]["error"] == "follows guard"
    assert tr.summary["errors"] == 1



@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_w0_cohort_issues_in_only_on_a_membership_change():
    tr = lengths.run(
        load_scenario({"batch": 4, "prompt_len": 8, "max_new_tokens": 30, "steps": 12})
    )
    st = [s for s in tr.steps() if s["phase"] == "decode"]
    assert st[0]["cache_instruction"] == "In"
    assert all(s["cache_instruction"] == "Nothing" for s in st[1:])
    assert all(s["padding_fraction"] == 0.0 for s in st)


@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_a_prompt_colliding_with_a_completion_key_runs_in_the_same_step():
    """§20.1 step 3 (unverified, derived): in W0 a fresh prompt's key len-1 can equal a
    completion's cache length; the completion forward runs, then the prompt forward."""
    sc = load_scenario({"requests": [{"prompt_len": 8, "max_new_tokens": 20},
                                     {"prompt_len": 9, "max_new_tokens": 20, "arrival": 1}],
                        "steps": 4, "depth": 2})
    st = list(lengths.run(sc).steps())
    assert (
        st[1]["phase"] == "decode"
        and st[1]["prefill"] == [1]
        and [r["seq"] for r in st[1]["rows"]] == [0]
    )
    assert normalized_lines(lengths.run(sc)) == normalized_lines(simulator.run(sc))



@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_requests_are_admitted_in_arrival_order_not_index_order():
    sc = load_scenario({"requests": [{"prompt_len": 4, "arrival": 2},
                                     {"prompt_len": 5, "arrival": 0}], "steps": 3, "depth": 0})
    st = list(simulator.run(sc).steps())
    assert st[0]["phase"] == "prompt" and st[0]["prefill"] == [1]
    assert [r["seq"] for r in st[0]["rows"]] == [1]



@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_an_idle_step_is_all_zero_and_keeps_the_running_rate():
    """No running sequence: phase idle, cohort, no instruction, zero counts and width, no
    bucket, no prefill, no error, and the tokens-per-step rate so far (the idle step adds
    nothing to the telemetry)."""
    sc = load_scenario({"requests": [{"prompt_len": 4, "max_new_tokens": 2},
                                     {"prompt_len": 4, "max_new_tokens": 2, "arrival": 6}],
                        "steps": 8, "depth": 2, "acceptance": "all-accept"})
    tr = simulator.run(sc)
    st = list(tr.steps())
    assert [s["phase"] for s in st] == ["prompt", "decode", "idle", "idle", "idle", "idle",
                                        "prompt", "decode"]
    rate = st[1]["tok_per_step"]
    # the decode drafted w - u = 2 and accepted both: the telemetry counts 1 + 2 (§15) while
    # the row commits the one token its max_new_tokens leaves
    assert rate == 3.0 and st[1]["committed"] == 1
    for t in (2, 3, 4, 5):
        want = {"step": t, "phase": "idle", "advance": "cohort", "cache_instruction": None,
                "running": 0, "waiting": 0, "buckets": 0, "groups": 0, "width": 0,
                "padding_fraction": 0.0, "committed": 0, "tok_per_step": rate, "bucket": None,
                "prefill": [], "error": None}
        got = tr.step_fields(t)
        assert got == want and list(got) == list(want)
        assert type(got["padding_fraction"]) is float and type(got["tok_per_step"]) is float
        assert st[t]["rows"] == [] and tr.row_array(t).shape == (0, len(policy.COL))



@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_an_idle_step_before_any_decode_has_rate_zero():
    sc = load_scenario({"requests": [{"prompt_len": 4, "arrival": 2}], "steps": 3, "depth": 0})
    st = list(simulator.run(sc).steps())
    assert [s["phase"] for s in st] == ["idle", "idle", "prompt"]
    assert st[0]["tok_per_step"] == 0.0 and st[0]["step"] == 0 and st[1]["step"] == 1



@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_a_mixed_step_commits_the_decode_rows_and_the_prompts_token():
    """A fresh prompt whose key collides with a completion runs in the same step: the step's
    committed count is the decode rows' plus one per prompt."""
    sc = load_scenario({"requests": [{"prompt_len": 8, "max_new_tokens": 20},
                                     {"prompt_len": 9, "max_new_tokens": 20, "arrival": 1}],
                        "steps": 2, "depth": 2, "acceptance": "all-accept"})
    st = list(simulator.run(sc).steps())[1]
    assert st["phase"] == "decode" and st["prefill"] == [1]
    assert [r["committed"] for r in st["rows"]] == [3]  # w = 3: 2 accepted + the bonus
    assert st["committed"] == 3 + 1



# ------------------------------------------------------------ budget and capacity near max_seq_len


@pytest.mark.rule("budget and capacity near max_seq_len")
def test_each_request_emits_exactly_its_max_new_tokens():
    sc = load_scenario(
        {"batch": 5, "prompt_len": [3, 9], "max_new_tokens": [1, 17], "steps": 80, "seed": 4}
    )
    tr = lengths.run(sc)
    emitted = {}
    for s in tr.steps():
        for r in s["rows"]:
            emitted[r["seq"]] = emitted.get(r["seq"], 0) + r["committed"]
        if s["phase"] != "prompt":  # a prompt that ran beside a decode: its one token
            for i in s["prefill"]:
                emitted[i] = emitted.get(i, 0) + 1
    assert any(s["prefill"] and s["phase"] == "decode" for s in tr.steps())
    assert emitted == {i: r.max_new_tokens for i, r in enumerate(sc.requests)}


@pytest.mark.rule("budget and capacity near max_seq_len")
def test_near_max_seq_len_the_verify_window_overhangs_the_cache_and_the_batch_fails():
    """No row ever holds more than max_seq_len tokens. Derived from §3 + §16: the verify
    forward appends w columns at C; once C + w passes a 512-multiple max_seq_len the
    capacity growth is refused ("kv-cache capacity ... above max_seq_len") and the batch's
    requests fail, before the budget clamp can bind. The draft KV (capacity 16 + 512k)
    already stopped growing at 16 here: every draft state was poisoned at priming."""
    sc = load_scenario(
        {
            "batch": 3,
            "prompt_len": 500,
            "max_new_tokens": 100,
            "steps": 60,
            "max_seq_len": 512,
            "acceptance": "all-accept",
        }
    )
    eng = simulator.TensorEngine(sc)
    tr = eng.run()
    assert all(len(eng.toks[i]) <= 512 for i in range(3))
    last = [s for s in tr.steps() if s["phase"] == "decode"][-1]
    assert last["error"] == "capacity refused" and last["width"] + sc.depth + 1 > 512
    assert all(r["drafted"] == 0 for s in tr.steps() for r in s["rows"])
    assert any("above max_seq_len" in m for m in tr.messages)
    assert normalized_lines(lengths.run(sc)) == normalized_lines(tr)



@pytest.mark.rule("budget and capacity near max_seq_len")
def test_a_prompt_that_reaches_max_new_tokens_ends_its_sequence():
    """max_new_tokens 1: the prompt step's token is the last; nothing else runs."""
    sc = load_scenario({"batch": 2, "prompt_len": 5, "max_new_tokens": 1, "steps": 4})
    tr = simulator.run(sc)
    assert [s["phase"] for s in tr.steps()] == ["prompt"]
    assert tr.step_fields(0)["committed"] == 2


@pytest.mark.rule("budget and capacity near max_seq_len")
def test_a_row_commits_no_more_than_its_max_new_tokens():
    """All drafts accepted (w = 4): rem = max_new_tokens - emitted; k = min(a, rem) drafts
    and the bonus only when rem > a. rem 3 = a 3: three drafts, no bonus; rem 2 < a: two."""
    for max_new, want in ((4, 3), (3, 2), (9, 4)):
        tr = simulator.run({"batch": 1, "prompt_len": 6, "max_new_tokens": max_new, "steps": 2,
                            "depth": 3, "acceptance": "all-accept"})
        (row,) = tr.rows(1)
        assert (row["drafted"], row["accepted"], row["committed"]) == (3, 3, want)



@pytest.mark.rule("budget and capacity near max_seq_len")
def test_a_request_stops_at_max_seq_len_tokens():
    """A 95-token prompt under max_seq_len 100, plain decoding (w = 1): one token per step
    until the sequence holds 100 tokens, then it is finished and the run stops."""
    sc = load_scenario({"requests": [{"prompt_len": 95, "max_new_tokens": 100}],
                        "max_seq_len": 100, "steps": 9, "depth": 0})
    eng = simulator.TensorEngine(sc)
    tr = eng.run()
    assert [(s["phase"], s["width"]) for s in tr.steps()] == [
        ("prompt", 95), ("decode", 95), ("decode", 96), ("decode", 97), ("decode", 98)]
    assert len(eng.toks[0]) == 100 and eng.done == {0}


# ----------------------------------------------- prompt priming (§7.4) and the draft-KV map (§7.1)


@pytest.mark.rule("prompt steps of the simulator")
@pytest.mark.parametrize("mode", [lengths, simulator])
def test_prompt_steps_prime_the_draft_kv(mode):
    """§7.4: a prompt of P tokens on a fresh state gives filled = L - 1 = P, so the first
    decode chain (start P - 1 = the seed) runs and every row drafts."""
    tr = mode.run(
        load_scenario({"batch": 3, "prompt_len": 7, "max_new_tokens": 20, "steps": 2, "depth": 3})
    )
    prompt, first = list(tr.steps())
    assert [r["filled"] for r in prompt["rows"]] == [7, 7, 7]
    assert [(r["u"], r["drafted"], r["chain_start"]) for r in first["rows"]] == [(1, 3, 6)] * 3


def state() -> DraftKv:
    return DraftKv(cache=None)


@pytest.mark.rule("draft-KV map LRU")
def test_the_map_keeps_its_models_mtp_block():
    block_model = TinyModel(ModelConfig(seed=1))
    assert SizedDraftKvMap(NumpyBackend(), block_model, 4).block is block_model.mtp
    heads = TinyModel(ModelConfig(mtp="heads", seed=1))
    assert SizedDraftKvMap(NumpyBackend(), heads, 4).block is None
    assert SizedDraftKvMap(NumpyBackend(), object(), 4).block is None


@pytest.mark.rule("draft-KV map LRU")
def test_every_checkin_is_stamped_with_the_next_tick():
    m = SizedDraftKvMap(NumpyBackend(), object(), None)
    states = [state() for _ in range(3)]
    for i, st in enumerate(states):
        m.checkin(i, st)
    assert [st.last_used for st in states] == [1, 2, 3]
    m.checkin(0, m.checkout_draft_kv(0))
    assert states[0].last_used == 4


@pytest.mark.rule("draft-KV map LRU")
def test_the_least_recently_checked_in_entry_is_evicted_above_the_cap():
    """Cap 2: 1 and 2 checked in, 1 checked out and in again (now the most recent), 3
    checked in: three entries, one too many, and 2 is the least recent: {1, 3} remain."""
    m = SizedDraftKvMap(NumpyBackend(), object(), 2)
    m.checkin(1, state())
    m.checkin(2, state())
    assert set(m.entries) == {1, 2}, "at the cap nothing is evicted"
    m.checkin(1, m.checkout_draft_kv(1))
    m.checkin(3, state())
    assert set(m.entries) == {1, 3}


@pytest.mark.rule("draft-KV map LRU")
def test_an_unbounded_map_never_evicts():
    m = SizedDraftKvMap(NumpyBackend(), object(), None)
    for i in range(70):
        m.checkin(i, state())
    assert len(m.entries) == 70


@pytest.mark.rule("draft-KV map LRU")
def test_checkout_returns_the_entry_or_a_fresh_state_with_the_backends_draft_kv():
    model = TinyModel(ModelConfig(seed=1))
    m = SizedDraftKvMap(NumpyBackend(), model, 4)
    mine = state()
    m.checkin(7, mine)
    assert m.checkout_draft_kv(7) is mine and 7 not in m.entries
    fresh = m.checkout_draft_kv(8)
    assert (fresh.filled, fresh.poisoned, fresh.seed) == (0, False, None)
    assert fresh.cache.current_seq_len == 0 and fresh.cache.k.capacity_seq_len == 16


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_step_failure_keeps_its_kind_and_shows_its_detail():
    exc = _StepFailed("capacity", "cache would grow past max_seq_len")
    assert (exc.kind, exc.detail) == ("capacity", "cache would grow past max_seq_len")
    assert str(exc) == "cache would grow past max_seq_len"


# ----------------------------------------------------------------------------- the engine's set-up


@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
@pytest.mark.parametrize(
    ("extra", "granted"),
    [({"world": "WB"}, False), (GRANTED, True), ({**GRANTED, "world": "W0"}, False)],
)
def test_the_engine_sets_up_its_scheduler_from_the_scenario(extra, granted):
    """Ragged admission (M §17) is granted only in WB with per-sequence advance granted; a
    refusal keeps its reason; both copies (scheduler, engine) hold the one decision. The
    scheduler state carries the scenario's world, running cap, WA prompt cap and prefill
    floor."""
    sc = load_scenario({"batch": 2, "prompt_len": 4, "max_new_tokens": 3, "steps": 2,
                        "max_seqs": 5, "prefill_max_seqs": 3, "prefill_floor": 2, **extra})
    eng = simulator.TensorEngine(sc)
    want = RaggedAdmission(True, None) if granted else RaggedAdmission(
        False, "per-sequence advance not granted")
    assert eng.state.admission == want and eng.state.engine_admission == want
    assert eng.state.world == sc.world and eng.state.max_seqs == 5 and eng.state.prefill_cap == 3
    assert eng.state.floor == PrefillFloor(2)
    assert simulator.TensorEngine(load_scenario({"batch": 1, "steps": 1})).state.floor == (
        PrefillFloor(4))



@pytest.mark.rule("acceptance models, integer and seeded")
def test_an_accept_file_must_cover_every_request_of_the_scenario(tmp_path):
    """The engine reads the accept file when it is built, with the scenario's request count
    (a file rewritten after the scenario was loaded is checked again)."""
    path = accept_file(tmp_path, {"0": [1], "1": [1]})
    sc = load_scenario({"batch": 2, "prompt_len": 4, "max_new_tokens": 3, "steps": 2,
                        "acceptance": {"model": "file", "path": path}})
    accept_file(tmp_path, {"0": [1]})
    with pytest.raises(ScenarioError) as err:
        simulator.TensorEngine(sc)
    assert str(err.value) == (
        f"scenario key 'acceptance.path': accept-count file {path!r} has no \"default\" list "
        "and no list for sequence(s) [1] (the scenario has 2 requests)")


class CountingBackend(NumpyBackend):
    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return super().forward(*args, **kwargs)


@pytest.mark.rule("per-step tensor hook")
def test_the_engine_runs_on_the_backend_it_is_given():
    be = CountingBackend()
    eng = simulator.TensorEngine(load_scenario({"batch": 1, "prompt_len": 4, "max_new_tokens": 3,
                                                "steps": 3}), backend=be)
    tr = eng.run()
    assert eng.be is be and be.forwards == sum(s["phase"] != "idle" for s in tr.steps()) == 2


@pytest.mark.rule("per-step tensor hook")
def test_run_loads_a_dict_and_passes_progress_and_backend_through():
    seen, spy = [], CountingBackend()
    tr = simulator.run({"batch": 1, "prompt_len": 4, "steps": 3},
                       lambda t, n: seen.append((t, n)), backend=spy)
    assert seen == [(1, 3), (2, 3), (3, 3)]  # after each step t: (t + 1, steps)
    assert spy.forwards == 3  # the prompt and two decodes ran on the given backend
    assert tr.tensors == [] and tr.tensor_log == []  # record_tensors defaults to off



@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_acceptance_telemetry_is_kept_per_request():
    eng = simulator.TensorEngine(load_scenario({"batch": 2, "prompt_len": 6, "max_new_tokens": 30,
                                                "steps": 3, "depth": 3,
                                                "acceptance": "all-accept"}))
    tr = eng.run()
    assert set(eng.tel.by_request) == {0, 1}
    for i in (0, 1):
        rows = [r for s in tr.steps() if s["phase"] == "decode" for r in s["rows"]
                if r["seq"] == i]
        assert eng.tel.by_request[i].proposed == sum(r["drafted"] for r in rows) == 6
        assert eng.tel.by_request[i].accepted == sum(r["accepted"] for r in rows) == 6



@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_engine_keeps_no_periodic_acceptance_report():
    """The engine's acceptance telemetry runs with logging off: past LOG_EVERY = 64
    proposals no report line is kept (the trace's markers are the report)."""
    sc = load_scenario({"batch": 4, "prompt_len": 4, "max_new_tokens": 30, "steps": 8,
                        "depth": 3, "acceptance": "all-reject"})
    eng = simulator.TensorEngine(sc)
    tr = eng.run()
    assert eng.tel.total.proposed == sum(r["drafted"] for s in tr.steps() for r in s["rows"]) > 64
    assert eng.tel.lines == []


# --------------------------------------------------------------- §17.2 mutations a run must expose


@pytest.mark.rule("batched_rollback_mutation_max_instead_of_min_is_caught")
def test_batched_rollback_mutation_max_instead_of_min_is_caught(monkeypatch):
    """§17.2: keep = max instead of min drives some tail to 0 (the run then leaves the
    window); the correct run keeps every tail in [1, 4]; the runs differ."""
    sc = load_scenario(
        {"batch": 4, "prompt_len": 6, "max_new_tokens": 40, "steps": 13, "depth": 3, "seed": 5}
    )
    good = simulator.run(sc)
    assert all(1 <= r["u"] <= 4 for s in good.steps() if s["phase"] == "decode" for r in s["rows"])

    def max_keep(uncached, accepted, w):
        valid = [u + a for u, a in zip(uncached, accepted, strict=False)]
        keep = max(valid)  # the mutation: max instead of min
        return step_mod.CohortPlan(keep, max(w - keep, 0), [max(v + 1 - keep, 0) for v in valid])

    monkeypatch.setattr(step_mod, "plan_batch_step", max_keep)
    bad = simulator.run(sc)
    us = [r["u"] for s in bad.steps() if s["phase"] in ("decode", "defer") for r in s["rows"]]
    assert min(us) == 0 or any(s["phase"] == "defer" for s in bad.steps())
    assert normalized_lines(bad) != normalized_lines(good)


@pytest.mark.rule("window_verify_row_off_by_one_destroys_acceptance")
def test_window_verify_row_off_by_one_destroys_acceptance():
    """§17.2: w=4, toks [1, 11], an always-agreeing draft oracle: 4 tokens emitted (3
    drafts + bonus); reading the verify rows one further (u + j) accepts fewer than 3."""
    oracle = ModelOracle(AllAccept(), 0, 64)
    toks = [1, 11]
    u, w = 1, 4
    drafts = oracle.draft(0, toks, w - u)
    window = toks[len(toks) - u:] + drafts
    # verify row r: the target's token after the window's first r + 1 tokens
    rows = [oracle.target(0, toks[: len(toks) - u] + window[: r + 1]) for r in range(w)]

    def run(row_of):
        targets = [rows[row_of(u, j)] for j in range(len(drafts)) if row_of(u, j) < w]
        a = len(verify_proposed(drafts, targets).accepted)
        return a, drafts[:a] + [rows[row_of(u, a)]] if row_of(u, a) < w else drafts[:a]

    a, emitted = run(window_verify_row)
    assert a == 3 and len(emitted) == 4
    a_bad, _ = run(lambda u_, j: u_ + j)
    assert a_bad < 3
