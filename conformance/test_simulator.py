"""The step simulator's flow (reference/simulator.py, tensor mode, and reference/lengths.py):
the spec's worked examples replayed end to end, the refusal chain, the engine worlds, the
trace files, and mutations of the step arithmetic that a run must expose.

Expected numbers come from the spec (cache-and-draft.md §16, §13; masks-and-scheduling.md
§18, §20); the acceptance file pins each row's accept count so the run reaches exactly the
spec's state."""

import json

import pytest

from raggedspec.reference import lengths, policy, simulator
from raggedspec.reference import step as step_mod
from raggedspec.reference.acceptance import AllAccept, ModelOracle
from raggedspec.reference.accounting import AcceptanceTelemetry
from raggedspec.reference.capability import KvAdvanceLatch
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.scheduler_telemetry import BucketTelemetry
from raggedspec.reference.step import verify_proposed, window_verify_row
from raggedspec.reference.trace import CSV_COLUMNS, Trace, read_trace, write_csv, write_jsonl


def steps_of(trace):
    return list(trace.steps())


def normalized_lines(trace):
    out = list(trace.lines())
    head = json.loads(out[0])
    head["mode"] = "-"
    return [json.dumps(head)] + out[1:]


def accept_file(tmp_path, counts):
    path = tmp_path / "accepts.json"
    path.write_text(json.dumps(counts))
    return str(path)


# ----------------------------------------------------------------------------- §16 examples


def cohort_example(tmp_path):
    """Two 9-token prompts; first decode: A accepts 0, B 1 (keep 1 -> C = 10, A u=1, B u=2);
    second decode is the spec's cohort example."""
    return load_scenario(
        {
            "requests": [
                {"prompt_len": 9, "max_new_tokens": 40},
                {"prompt_len": 9, "max_new_tokens": 40},
            ],
            "depth": 3,
            "steps": 4,
            "acceptance": {
                "model": "file",
                "path": accept_file(tmp_path, {"0": [0, 3], "1": [1, 0]}),
            },
        }
    )


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
@pytest.mark.parametrize("mode", [lengths, simulator])
def test_the_cohort_example_w4_c10(tmp_path, mode):
    """§16 cohort example: A L=11 (u=1) drafts 3, B L=12 (u=2) drafts 2; groups (1,9)=[A],
    (2,10)=[B]; A accepts 3, B 0 -> keep 2, n_drop 2, cache 12; A L=15 u'=3, B L=13 u'=1."""
    st = steps_of(mode.run(cohort_example(tmp_path)))
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


def per_sequence_example(tmp_path):
    """A (seq 0) prefilled with 12 tokens, B (seq 1) with 10; both then decode together
    under granted per-sequence advance (WB); A accepts 2, B 0."""
    return load_scenario(
        {
            "requests": [
                {"prompt_len": 12, "max_new_tokens": 40},
                {"prompt_len": 10, "max_new_tokens": 40},
            ],
            "depth": 3,
            "steps": 4,
            "advance": "per-sequence",
            "world": "WB",
            "admission": "grant",
            "xs_per_seq": True,
            "acceptance": {"model": "file", "path": accept_file(tmp_path, {"0": [2], "1": [0]})},
        }
    )


@pytest.mark.rule("PerSequence example and the per-sequence commit")
@pytest.mark.parametrize("mode", [lengths, simulator])
def test_the_per_sequence_example(tmp_path, mode):
    """§16 PerSequence example: own KV A 12, B 10 -> lead_pad [0,2], cache_lens [12,10]; one
    group (1,0), chain starts [11,9]; A accepts 2, B 0 -> committed [3,1]; set_len A 15,
    B 11; draft filled [15,11]."""
    st = steps_of(mode.run(per_sequence_example(tmp_path)))
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
    sc = load_scenario(per_sequence_example(tmp_path).to_dict(), {"steps": 3})
    eng = simulator.TensorEngine(sc)
    eng.run()
    assert [eng.caches[i].current_seq_len for i in (0, 1)] == [15, 11]
    assert [eng.caches[i].slots[0].k.current_data().shape[2] for i in (0, 1)] == [15, 11]
    assert [eng.dmap.entries[i].filled for i in (0, 1)] == [15, 11]
    assert [eng.dmap.entries[i].seed[0] for i in (0, 1)] == [14, 10]  # = the next chain starts
    assert [eng.dmap.entries[i].cache.current_seq_len for i in (0, 1)] == [15, 11]


# ----------------------------------------------------------------------------- refusal chain (§13)


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


# ----------------------------------------------------------------------------- worlds (§18, §20)


GRANTED = {"advance": "per-sequence", "xs_per_seq": True, "admission": "grant"}


@pytest.mark.rule("scheduler worlds, bucket selection, engine cache instruction")
def test_granted_per_sequence_advance_in_w0_shatters_the_batch():
    """Site 2 of §13: W0 buckets by cache_bucket_len, so ragged commits split the cohort."""
    tr = lengths.run(
        load_scenario(
            {
                "batch": 8,
                "prompt_len": 16,
                "max_new_tokens": 60,
                "steps": 30,
                "world": "W0",
                "max_draft_kv_seqs": None,
                **GRANTED,
            }
        )
    )
    st = [s for s in tr.steps() if s["phase"] == "decode"]
    assert max(s["buckets"] for s in st) > 1
    assert min(s["running"] for s in st) < 8
    assert "shattered=0 " not in tr.markers()[1]


@pytest.mark.rule("window check, the two guards and the deferral")
def test_granted_per_sequence_advance_in_wa_trips_the_follows_guard():
    """Site 1 of §13: WA keeps the decode cohort in one bucket, the engine then issues
    Nothing, and a PerSequence step that did not assemble the batch is refused."""
    tr = lengths.run(
        load_scenario(
            {
                "batch": 4,
                "prompt_len": 16,
                "max_new_tokens": 60,
                "steps": 10,
                "world": "WA",
                **GRANTED,
            }
        )
    )
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
    st = steps_of(lengths.run(sc))
    assert (
        st[1]["phase"] == "decode"
        and st[1]["prefill"] == [1]
        and [r["seq"] for r in st[1]["rows"]] == [0]
    )
    assert normalized_lines(lengths.run(sc)) == normalized_lines(simulator.run(sc))


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
    assert last["error"] == "capacity refused" and last["width"] + sc.w > 512
    assert all(r["drafted"] == 0 for s in tr.steps() for r in s["rows"])
    assert any("above max_seq_len" in m for m in tr.messages)
    assert normalized_lines(lengths.run(sc)) == normalized_lines(tr)


# ----------------------------------------------------------------------------- trace files


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_trace_is_byte_identical_for_the_same_scenario_and_seed(tmp_path):
    sc = load_scenario(
        {
            "batch": 6,
            "prompt_len": [4, 12],
            "max_new_tokens": [10, 30],
            "steps": 40,
            "seed": 3,
            "arrival": "staggered",
            **GRANTED,
            "world": "WB",
        }
    )
    p1, p2, p3 = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_jsonl(lengths.run(sc), p1)
    write_jsonl(lengths.run(load_scenario(sc.to_dict())), p2)
    write_jsonl(lengths.run(load_scenario(sc.to_dict(), {"seed": 4})), p3)
    assert p1.read_bytes() == p2.read_bytes()
    assert p1.read_bytes() != p3.read_bytes()


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_trace_follows_schema_v1_and_round_trips(tmp_path):
    sc = load_scenario(
        {"batch": 3, "prompt_len": 6, "max_new_tokens": 9, "steps": 10, **GRANTED, "world": "WB"}
    )
    tr = simulator.run(sc)
    path = tmp_path / "t.jsonl"
    write_jsonl(tr, path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    head, summary = lines[0], lines[-1]
    assert (head["type"], head["schema"], head["version"], head["mode"]) == (
        "header",
        "raggedspec-trace",
        1,
        "tensor",
    )
    assert load_scenario(head["scenario"]) == sc
    step_keys = [
        "type",
        "step",
        "phase",
        "advance",
        "cache_instruction",
        "running",
        "waiting",
        "buckets",
        "groups",
        "width",
        "padding_fraction",
        "committed",
        "tok_per_step",
        "rows",
    ]
    row_keys = [
        "seq",
        "row",
        "own_len",
        "width",
        "lead",
        "u",
        "drafted",
        "accepted",
        "committed",
        "group",
        "chain_start",
        "filled",
        "bucket",
    ]
    for s in lines[1:-1]:
        assert list(s)[: len(step_keys)] == step_keys
        for r in s["rows"]:
            assert list(r) == row_keys and r["lead"] == r["width"] - r["own_len"]
    assert list(summary)[:8] == [
        "type",
        "steps",
        "decode_steps",
        "committed",
        "tok_per_step",
        "max_spread",
        "mean_padding_fraction",
        "refusal",
    ]
    back = read_trace(path)
    assert list(back.lines()) == list(tr.lines())
    assert back.markers() == tr.markers()


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_csv_has_one_line_per_step_and_row(tmp_path):
    tr = lengths.run(load_scenario({"batch": 3, "prompt_len": 6, "max_new_tokens": 9, "steps": 10}))
    path = tmp_path / "t.csv"
    write_csv(tr, path)
    text = path.read_text().splitlines()
    assert text[0] == ",".join(CSV_COLUMNS)
    assert len(text) - 1 == sum(len(s["rows"]) for s in tr.steps())
    back = read_trace(path)
    assert [r["own_len"] for s in back.steps() for r in s["rows"]] == \
        [r["own_len"] for s in tr.steps() for r in s["rows"]]
    first_decode = next(s for s in back.steps() if s["phase"] == "decode")
    assert (
        first_decode["rows"][0]["bucket"] == [6, 0, 0] or first_decode["rows"][0]["bucket"][0] == 6
    )


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_markers_are_the_spec_lines():
    tr = lengths.run(load_scenario({"batch": 4, "prompt_len": 8, "max_new_tokens": 20, "steps": 12,
                                    "acceptance": "all-accept", "depth": 3}))
    mtp, sched = tr.markers()
    assert mtp.startswith("MTP[agg] accept_rate=1.0000 ") and " tok_per_step=4.0000 " in mtp
    assert sched.startswith("SCHED[agg] calls=") and "shattered_frac=" in sched
    idle = lengths.run(load_scenario({"requests": [{"prompt_len": 4, "arrival": 50}], "steps": 3}))
    assert [m.split(" ")[0] for m in idle.markers()] == ["MTP[agg]"]  # no SCHED line at calls = 0
    assert [s["phase"] for s in idle.steps()] == ["idle"] * 3


@pytest.mark.rule("per-step tensor hook")
def test_record_tensors_keeps_each_verify_forward():
    sc = load_scenario({"batch": 2, "prompt_len": 6, "max_new_tokens": 8, "steps": 4, "depth": 2})
    tr = simulator.run(sc, record_tensors=True)
    assert len(tr.tensors) == 3
    rec = tr.tensors[0]
    assert rec["tokens"].shape == (2, 3) and rec["logits"].shape[:2] == (2, 3)
    assert rec["hidden"].shape[:2] == (2, 3) and rec["target_k0"].shape[0] == 2
    assert rec["positions"] == [6]


# ----------------------------------------------------------------------------- mutations


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


# ----------------------------------------------------------------------------- the shared policy


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_summary_totals_are_brute_forced_from_a_fresh_run():
    # a fresh (uncached) run: one prompt step, then several decode steps
    tr = lengths.run(load_scenario(dict(batch=2, prompt_len=[3, 9], max_new_tokens=12, steps=8)))
    steps = list(tr.steps())
    decode = [s for s in steps if s["phase"] == "decode"]
    assert 2 <= len(decode) < len(steps) and len(decode) != len(steps) - len(decode)
    assert steps[-1]["committed"] < sum(s["committed"] for s in steps)  # non-degenerate
    assert tr.summary["steps"] == len(steps)
    assert tr.summary["decode_steps"] == len(decode)
    assert tr.summary["committed"] == sum(s["committed"] for s in steps)
    rows = [r for s in decode for r in s["rows"]]
    assert tr.summary["tok_per_step"] == sum(1 + r["accepted"] for r in rows) / len(rows) > 1


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_an_empty_run_summarizes_to_zeros():
    summary = policy.summarize(Trace("lengths", {}), AcceptanceTelemetry(), BucketTelemetry(),
                               KvAdvanceLatch(False, False), 0)
    assert {k: summary[k] for k in ("steps", "decode_steps", "committed", "tok_per_step",
                                    "max_spread", "mean_padding_fraction", "refusal", "errors",
                                    "shattered_steps")} == {
        "steps": 0, "decode_steps": 0, "committed": 0, "tok_per_step": 0.0, "max_spread": 0,
        "mean_padding_fraction": 0.0, "refusal": None, "errors": 0, "shattered_steps": 0}


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_step_fields_names_every_schema_field_in_order():
    names = ["step", "phase", "advance", "cache_instruction", "running", "waiting", "buckets",
             "groups", "width", "padding_fraction", "committed", "tok_per_step", "bucket",
             "prefill", "error"]
    fields = policy.step_fields(*range(100, 115))
    assert list(fields.items()) == list(zip(names, range(100, 115), strict=True))


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
