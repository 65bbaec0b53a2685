"""Scenarios (reference/scenario.py) and acceptance models / token oracles
(reference/acceptance.py): loading, overrides, validation messages, and the integer,
batch-independent acceptance randomness the simulator relies on."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.acceptance import (
    AllAccept,
    AllReject,
    CheckedOracle,
    FileStream,
    Geometric,
    Heterogeneous,
    ModelOracle,
    OracleError,
    Profile,
    key_hash,
    threshold,
)
from raggedspec.reference.errors import ScenarioError
from raggedspec.reference.scenario import Request, load_scenario, model_config, parse_acceptance
from raggedspec.reference.step import verify_proposed

# ----------------------------------------------------------------------------- loading


@pytest.mark.rule("scenario config and validation")
def test_defaults_load_and_round_trip_through_to_dict():
    sc = load_scenario()
    assert sc.batch == 8 and sc.depth == 3 and sc.w == 4
    assert (sc.advance, sc.world, sc.admission, sc.strip) == ("cohort", "W0", "refuse", "eager")
    assert sc.per_seq_kv is False and sc.xs_per_seq is False and sc.max_draft_kv_seqs == 64
    assert load_scenario(sc.to_dict()) == sc
    assert load_scenario(json.loads(json.dumps(sc.to_dict()))) == sc


@pytest.mark.rule("scenario config and validation")
def test_toml_and_json_files_load_the_same_scenario(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text(
        'batch = 3\ndepth = 2\nprompt_len = [4, 9]\nacceptance = "profile:0.74,0.54,0.41"\n'
        "[model]\nvocab = 32\n"
    )
    js = tmp_path / "s.json"
    js.write_text(json.dumps({"batch": 3, "depth": 2, "prompt_len": [4, 9], "model": {"vocab": 32},
                              "acceptance": {"model": "profile", "p": [0.74, 0.54, 0.41]}}))
    a, b = load_scenario(toml), load_scenario(js)
    assert a == b
    assert a.acceptance.p == (0.74, 0.54, 0.41) and a.model == {"vocab": 32}
    assert all(4 <= r.prompt_len <= 9 for r in a.requests)


@pytest.mark.rule("request generator")
def test_the_generator_is_seeded_and_staggers_arrivals():
    a = load_scenario({"batch": 20, "prompt_len": [1, 50], "max_new_tokens": [5, 9], "seed": 7,
                       "arrival": "staggered", "stagger": 3})
    b = load_scenario({"batch": 20, "prompt_len": [1, 50], "max_new_tokens": [5, 9], "seed": 7,
                       "arrival": "staggered", "stagger": 3})
    c = load_scenario({"batch": 20, "prompt_len": [1, 50], "max_new_tokens": [5, 9], "seed": 8})
    assert a.requests == b.requests and a.requests != c.requests
    assert [r.arrival for r in a.requests] == [3 * i for i in range(20)]
    assert len({r.prompt_len for r in a.requests}) > 5


@pytest.mark.rule("scenario config and validation")
def test_explicit_requests_and_overrides():
    sc = load_scenario(
        {
            "requests": [
                {"prompt_len": 5, "max_new_tokens": 7},
                {"prompt_len": 6, "max_new_tokens": 8, "arrival": 2, "may_draft": False},
            ]
        },
        ["depth=5", "model.vocab=16", 'world="WB"'],
    )
    assert sc.requests == (Request(5, 7, 0, True), Request(6, 8, 2, False))
    assert sc.depth == 5 and sc.model == {"vocab": 16} and sc.world == "WB"
    gqa = load_scenario({"model": {"n_heads": 8, "n_kv_heads": 2}})
    assert (model_config(gqa).n_heads, model_config(gqa).n_kv_heads) == (8, 2)
    assert model_config(sc).n_kv_heads == 1  # the default: one KV head
    sc2 = load_scenario(None, {"batch": 2, "acceptance": "geometric:0.5", "acceptance.p": [0.25]})
    assert sc2.batch == 2 and sc2.acceptance.p == (0.25,)


@pytest.mark.rule("advance request vs flags and the refusal chain")
def test_per_sequence_advance_sets_the_flag_it_stands_for():
    assert load_scenario({"advance": "per-sequence"}).per_seq_kv is True
    assert load_scenario({"advance": "cohort"}).per_seq_kv is False


@pytest.mark.rule("scenario config and validation")
@pytest.mark.parametrize("data, key, words", [
    ({"bogus": 1}, "bogus", "unknown key"),
    ({"batch": 0}, "batch", "1..="),
    ({"depth": 9}, "depth", "0..=8"),
    ({"depth": -1}, "depth", "0..=8"),
    ({"prompt_len": -3}, "prompt_len", ">= 1"),
    ({"prompt_len": [9, 4]}, "prompt_len", "low <= high"),
    ({"max_new_tokens": 0}, "max_new_tokens", ">= 1"),
    ({"max_seq_len": 1}, "max_seq_len", "in 2..=2147483647"),
    ({"max_seq_len": 2**31}, "max_seq_len", "in 2..=2147483647"),
    ({"advance": "ragged"}, "advance", "cohort, per-sequence"),
    ({"world": "W9"}, "world", "W0, WA, WB"),
    ({"strip": "sometimes"}, "strip", "eager, lazy, none"),
    ({"admission": "yes"}, "admission", "refuse, grant"),
    ({"per_seq_kv": True}, "per_seq_kv", "advance"),
    ({"xs_per_seq": "1"}, "xs_per_seq", "true or false"),
    ({"steps": 0}, "steps", "1..="),
    ({"requests": [{"prompt_len": 4}], "batch": 2}, "batch", "explicit requests list"),
    ({"requests": [{"prompt_len": 0}]}, "requests[0].prompt_len", "1..="),
    ({"requests": [{"prompt_len": 4, "colour": 1}]}, "requests[0].colour", "unknown key"),
    ({"acceptance": "geometric:1.5"}, "acceptance.p", "[0, 1]"),
    ({"acceptance": "sometimes"}, "acceptance.model", "geometric"),
    ({"acceptance": {"model": "file"}}, "acceptance.path", "JSON path"),
    ({"model": {"layers": 3}}, "model.layers", "unknown key"),
    ({"model": {"vocab": 1}}, "model.vocab", ">= 2"),
    ({"model": {"n_heads": 4, "n_kv_heads": 3}}, "model", "n_kv_heads 3 must be >= 1 and divide"),
    ({"max_draft_kv_seqs": 0}, "max_draft_kv_seqs", ">= 1"),
])
def test_a_bad_scenario_names_the_key_and_the_allowed_range(data, key, words):
    with pytest.raises(ScenarioError) as err:
        load_scenario(data)
    assert f"'{key}'" in str(err.value) and words in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.rule("scenario config and validation")
def test_a_missing_file_is_a_scenario_error(tmp_path):
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario(tmp_path / "nope.toml")


# ------------------------------------------------ acceptance configuration is checked at load time


def _accept_file(tmp_path, text, name="acc.json"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.rule("scenario config and validation", "acceptance models, integer and seeded")
@pytest.mark.parametrize(
    "make, key, words",
    [
        (
            lambda d: "file:/nonexistent/accepts.json",
            "acceptance.path",
            ["/nonexistent/accepts.json", "does not exist"],
        ),
        (lambda d: "file:" + str(d), "acceptance.path", ["is not a file"]),
        (
            lambda d: "file:" + _accept_file(d, "[1,-2]"),
            "acceptance.path",
            ["acc.json", "[1, -2]", ">= 0"],
        ),
        (
            lambda d: "file:" + _accept_file(d, "[1, true]"),
            "acceptance.path",
            ["[1, True]", "integers"],
        ),
        (lambda d: "file:" + _accept_file(d, "[]"), "acceptance.path", ["non-empty"]),
        (
            lambda d: "file:" + _accept_file(d, "not json"),
            "acceptance.path",
            ["acc.json", "not valid JSON"],
        ),
        (
            lambda d: "file:" + _accept_file(d, '{"x": [1]}'),
            "acceptance.path",
            ["'x'", "sequence id"],
        ),
        (
            lambda d: "file:" + _accept_file(d, '{"0": [1], "2": [0]}'),
            "acceptance.path",
            ['no "default"', "[1]"],
        ),
        (
            lambda d: "oracle:nosuchmod_xyz:f",
            "acceptance.factory",
            ["nosuchmod_xyz:f", "cannot import"],
        ),
        (lambda d: "oracle:os:sep", "acceptance.factory", ["os:sep", "not callable"]),
        (
            lambda d: "oracle:os:no_such_attr",
            "acceptance.factory",
            ["os:no_such_attr", "no attribute"],
        ),
    ],
)
def test_bad_acceptance_files_and_factories_are_refused_at_load_time(tmp_path, make, key, words):
    """A missing or malformed accept file and an oracle factory that does not import or is
    not callable are configuration errors found by load_scenario, naming the key and the
    bad path or factory (the CLI turns them into exit 2, conformance/test_cli.py)."""
    with pytest.raises(ScenarioError) as err:
        load_scenario({"batch": 3, "acceptance": make(tmp_path)})
    msg = str(err.value)
    assert f"'{key}'" in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.rule("acceptance models, integer and seeded")
def test_a_file_with_a_list_per_sequence_and_no_default_loads_when_it_covers_every_request(
    tmp_path,
):
    path = _accept_file(tmp_path, '{"0": [1], "1": [0, 2], "2": [3]}')
    assert load_scenario({"batch": 3, "acceptance": f"file:{path}"}).acceptance.path == path
    with pytest.raises(ScenarioError, match=r"sequence\(s\) \[3\]"):
        load_scenario({"batch": 4, "acceptance": f"file:{path}"})


@pytest.mark.rule("acceptance models, integer and seeded")
@pytest.mark.parametrize(
    "value, key, words",
    [
        ("profile:", "acceptance", ["'profile:'", "after the colon"]),
        ("heterogeneous:", "acceptance", ["after the colon"]),
        ("geometric:", "acceptance", ["after the colon"]),
        ("profile", "acceptance.p", ["profile needs 1..=8", "got []"]),
        ("heterogeneous", "acceptance.p", ["at least two", "got []"]),
        ("heterogeneous:0.5", "acceptance.p", ["at least two", "geometric", "[0.5]"]),
        ({"model": "profile"}, "acceptance.p", ["profile needs"]),
        (
            {"model": "heterogeneous", "p": [0.2, 0.9], "p_range": [0.1, 0.2]},
            "acceptance.p",
            ["not both"],
        ),
        ("profile:" + ",".join(["0.5"] * 9), "acceptance.p", ["1..=8"]),
        ("all-accept:0.5", "acceptance", ["takes no argument"]),
        ("geometric:0.5,0.6", "acceptance.p", ["exactly one"]),
    ],
)
def test_a_probability_model_without_its_probabilities_is_refused(value, key, words):
    """`profile:` or `heterogeneous` with no probabilities no longer silently becomes
    [0.7]; heterogeneous needs two or more (one would be geometric)."""
    with pytest.raises(ScenarioError) as err:
        load_scenario({"acceptance": value})
    msg = str(err.value)
    assert f"'{key}'" in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.rule("scenario config and validation", "acceptance models, integer and seeded")
def test_bare_geometric_is_the_documented_default_and_tables_round_trip():
    assert load_scenario({"acceptance": "geometric"}).acceptance.p == (0.7,)
    for value in (
        "heterogeneous:0.2,0.9",
        {"model": "heterogeneous", "p_range": [0.3, 0.9]},
        "all-accept",
        "profile:0.74,0.54,0.41",
    ):
        sc = load_scenario({"acceptance": value})
        assert load_scenario(sc.to_dict()) == sc
    assert load_scenario({"acceptance": "all-reject"}).to_dict()["acceptance"] == {
        "model": "all-reject"
    }
    # a dotted override reaches into a string form without inventing probabilities
    sc = load_scenario(
        {"acceptance": {"model": "heterogeneous", "p_range": [0.3, 0.9]}},
        ["acceptance.p_range=[0.1,0.2]"],
    )
    assert sc.acceptance.p_range == (0.1, 0.2) and sc.acceptance.p == ()


@pytest.mark.rule("acceptance models, integer and seeded")
def test_acceptance_shorthands():
    assert parse_acceptance("all-accept").model == "all-accept"
    assert parse_acceptance("heterogeneous:0.2,0.9").p == (0.2, 0.9)
    assert parse_acceptance("file:x.json").path == "x.json"
    assert parse_acceptance(
        "oracle:raggedspec.conformance.test_scenario:make_oracle"
    ).factory.endswith(":make_oracle")


# ----------------------------------------------------------------------------- acceptance


def brute_run(seed: int, seq: int, pos: int, n: int, thresholds) -> int:
    """Independent oracle: walk the drafts one by one, stop at the first wrong one."""
    a = 0
    for j in range(n):
        draw = int(key_hash(seed, 0xA11CE, seq, pos + j)[0]) >> 32
        if draw >= thresholds[j]:
            break
        a += 1
    return a


@pytest.mark.rule("acceptance models, integer and seeded")
@given(
    seq=st.integers(0, 500), pos=st.integers(0, 5000), n=st.integers(0, 8), seed=st.integers(0, 99)
)
def test_geometric_and_profile_match_a_brute_force_walk(seq, pos, n, seed):
    g = Geometric(0.6, seed)
    assert g.accept_one(seq, pos, n) == brute_run(seed, seq, pos, n, [threshold(0.6)] * 8)
    prof = Profile([0.9, 0.5, 0.3], seed)
    want = brute_run(
        seed, seq, pos, n, [threshold(p) for p in (0.9, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3)]
    )
    assert prof.accept_one(seq, pos, n) == want


@pytest.mark.rule("acceptance models, integer and seeded")
def test_geometric_has_the_geometric_distribution():
    rows = 40_000
    a = Geometric(0.7, 3).accepted(np.arange(rows) % 97, np.arange(rows) * 13, np.full(rows, 3), 0)
    freq = np.bincount(a, minlength=4) / rows
    assert np.allclose(freq, [0.3, 0.21, 0.147, 0.343], atol=0.01)


@pytest.mark.rule("acceptance models, integer and seeded")
def test_the_profile_separates_positions():
    rows = 40_000
    a = Profile([0.74, 0.54, 0.41], 1).accepted(
        np.arange(rows), np.arange(rows), np.full(rows, 3), 0
    )
    p0 = (a >= 1).mean()
    p1 = (a >= 2).sum() / (a >= 1).sum()
    p2 = (a >= 3).sum() / (a >= 2).sum()
    assert abs(p0 - 0.74) < 0.01 and abs(p1 - 0.54) < 0.015 and abs(p2 - 0.41) < 0.02


@pytest.mark.rule("acceptance models, integer and seeded")
def test_heterogeneous_rates_are_per_sequence():
    h = Heterogeneous([0.05, 0.95], 0)
    seqs = np.repeat([0, 1], 5000)
    a = h.accepted(seqs, np.arange(10_000), np.full(10_000, 1), 0)
    assert a[:5000].mean() < 0.1 and a[5000:].mean() > 0.9
    r = Heterogeneous([], 0, (0.2, 0.4))
    t = r.per_sequence_threshold(np.arange(1000))
    assert t.min() >= threshold(0.2) and t.max() <= threshold(0.4) and len(set(t.tolist())) > 100


@pytest.mark.rule("acceptance models, integer and seeded")
def test_all_accept_all_reject_and_the_file_stream(tmp_path):
    n = np.array([0, 1, 3, 8])
    assert AllAccept().accepted([0] * 4, [5] * 4, n, 0).tolist() == [0, 1, 3, 8]
    assert AllReject().accepted([0] * 4, [5] * 4, n, 0).tolist() == [0, 0, 0, 0]
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"default": [1], "2": [3, 0, 5]}))
    f = FileStream(path)
    assert f.accepted([2, 2, 2, 2], [0] * 4, [3, 3, 3, 3], [0, 1, 2, 3]).tolist() == [3, 0, 3, 3]
    assert f.accepted([7], [0], [3], [9]).tolist() == [1]
    assert FileStream([2, 0]).accepted([1, 1], [0, 0], [1, 3], [0, 1]).tolist() == [1, 0]


@pytest.mark.rule("randomness keyed by (seed, seq, position), not by row")
@given(
    seqs=st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True),
    pos=st.integers(0, 4000),
    n=st.integers(0, 8),
)
def test_accepts_do_not_depend_on_batch_mates_or_row_order(seqs, pos, n):
    """Keyed by (seed, seq, absolute position): a row's count is the same alone, in any
    batch, at any row."""
    m = Profile([0.8, 0.6, 0.4], 11)
    k = len(seqs)
    batched = m.accepted(seqs, [pos] * k, [n] * k, 0)
    reversed_ = m.accepted(seqs[::-1], [pos] * k, [n] * k, 0)[::-1]
    alone = [m.accept_one(s, pos, n) for s in seqs]
    assert batched.tolist() == alone == reversed_.tolist()


@pytest.mark.rule("pluggable token oracle")
@given(seq=st.integers(0, 300), ctx_len=st.integers(1, 300), n=st.integers(0, 8),
       model=st.sampled_from(["geo", "prof", "all", "none"]))
def test_the_model_oracle_verifies_to_exactly_the_models_count(seq, ctx_len, n, model):
    m = {
        "geo": Geometric(0.6, 5),
        "prof": Profile([0.9, 0.4], 5),
        "all": AllAccept(),
        "none": AllReject(),
    }[model]
    oracle = ModelOracle(m, 5, 16)
    ctx = oracle.prompt(seq, ctx_len)
    drafts = oracle.draft(seq, ctx, n)
    targets = [oracle.target(seq, ctx + drafts[:j]) for j in range(n)]
    assert len(drafts) == n and all(0 <= x < 16 for x in drafts + targets + ctx)
    assert len(verify_proposed(drafts, targets).accepted) == m.accept_one(seq, ctx_len, n)
    # the committed stream is the true stream whatever was accepted
    assert targets[:1] == oracle.true_tokens(seq, ctx_len, 1)[: len(targets[:1])]


class _ConstantOracle:
    """A custom token oracle for the factory test: every target is 1; drafts are all 1
    except the last, which is 2 (so n - 1 of n drafts are accepted)."""

    def prompt(self, seq_id, length):
        return [1] * length

    def target(self, seq_id, context):
        return 1

    def draft(self, seq_id, context, n):
        return [1] * (n - 1) + [2] if n else []


def make_oracle(scenario):
    return _ConstantOracle()


class _ShortDrafter(_ConstantOracle):
    """Breaks the protocol: proposes one draft fewer than asked."""

    def draft(self, seq_id, context, n):
        return [1] * (n - 1)


class _OutOfVocab(_ConstantOracle):
    """Breaks the protocol: the target after a 7-token context is token 64 = vocab."""

    def target(self, seq_id, context):
        return 64 if len(context) >= 7 else 1


def make_short_drafter(scenario):
    return _ShortDrafter()


def make_out_of_vocab(scenario):
    return _OutOfVocab()


class _LateBadPrompt(_ConstantOracle):
    """Breaks the protocol for sequence 1 only: its prompt is one token short. Both modes
    ask for a request's prompt when it arrives, so both refuse at the same call."""

    def prompt(self, seq_id, length):
        return [1] * (length - (seq_id == 1))


def make_late_bad_prompt(scenario):
    return _LateBadPrompt()


def make_not_an_oracle(scenario):
    return object()


def make_raising(scenario):
    raise RuntimeError("the oracle's weights are missing")


@pytest.mark.rule("pluggable token oracle")
def test_the_checked_oracle_refuses_every_breach_of_the_protocol():
    """CheckedOracle is the one place both modes check a custom oracle: the number of
    tokens and each token's range, naming the call and the bad value."""
    good = CheckedOracle(_ConstantOracle(), vocab=4, name="m:f")
    assert (
        good.prompt(0, 3) == [1, 1, 1]
        and good.draft(0, [1], 2) == [1, 2]
        and good.draft(0, [1], 0) == []
    )
    assert (
        CheckedOracle(
            type("O", (_ConstantOracle,), {"target": lambda self, s, c: np.int64(3)})(), 4
        ).target(0, [])
        == 3
    )
    cases = [
        (
            lambda o: o.draft(2, [1, 1], 3),
            CheckedOracle(_ShortDrafter(), 64, "m:f"),
            ["draft(seq_id=2, context of 2 tokens, n=3)", "[1, 1]", "exactly 3"],
        ),
        (
            lambda o: o.target(0, [1] * 7),
            CheckedOracle(_OutOfVocab(), 64, "m:f"),
            ["target(seq_id=0, context of 7 tokens)", "64", "[0, vocab = 64)"],
        ),
        (
            lambda o: o.prompt(1, 4),
            CheckedOracle(
                type("P", (_ConstantOracle,), {"prompt": lambda self, s, n: [1] * (n + 1)})(), 64
            ),
            ["prompt(seq_id=1, length=4)", "exactly 4"],
        ),
        (
            lambda o: o.target(0, []),
            CheckedOracle(type("B", (_ConstantOracle,), {"target": lambda self, s, c: True})(), 64),
            ["returned True"],
        ),
        (
            lambda o: o.draft(0, [], 2),
            CheckedOracle(
                type("N", (_ConstantOracle,), {"draft": lambda self, s, c, n: None})(), 64
            ),
            ["returned None"],
        ),
        (
            lambda o: o.draft(0, [], 2),
            CheckedOracle(
                type("M", (_ConstantOracle,), {"draft": lambda self, s, c, n: [1, -1]})(), 64
            ),
            ["[1, -1]"],
        ),
    ]
    for call, oracle, words in cases:
        with pytest.raises(OracleError) as err:
            call(oracle)
        msg = str(err.value)
        assert "'acceptance.factory'" in msg and isinstance(err.value, ScenarioError)
        for w in words:
            assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.rule("pluggable token oracle")
@pytest.mark.parametrize("factory, words", [
    ("make_not_an_oracle", ["make_not_an_oracle", "no callable prompt, target, draft"]),
    ("make_raising", ["make_raising", "RuntimeError", "weights are missing"]),
])
def test_a_factory_whose_result_is_not_an_oracle_is_a_scenario_error(factory, words):
    from raggedspec.reference.acceptance import build_model

    sc = load_scenario({"acceptance": f"oracle:raggedspec.conformance.test_scenario:{factory}"})
    with pytest.raises(ScenarioError) as err:
        build_model(sc.acceptance, sc.seed, sc)
    assert "'acceptance.factory'" in str(err.value)
    for w in words:
        assert w in str(err.value)


@pytest.mark.rule("pluggable token oracle")
def test_a_custom_token_oracle_loads_from_a_factory():
    from raggedspec.reference.acceptance import build_model, build_oracle

    sc = load_scenario({"acceptance": "oracle:raggedspec.conformance.test_scenario:make_oracle"})
    model = build_model(sc.acceptance, sc.seed, sc)
    assert model.needs_tokens
    oracle = build_oracle(model, 0, 64)
    # the factory string imports this module under its installed name, which may be a second
    # copy of the module pytest imported: compare the class by name
    assert isinstance(oracle, CheckedOracle)
    assert type(oracle.oracle).__qualname__ == _ConstantOracle.__qualname__
    assert oracle.draft(0, [1, 1], 3) == [1, 1, 2] and oracle.target(0, [1]) == 1


@pytest.mark.rule("scenario config and validation")
def test_the_example_scenarios_load():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.[tj][os][mo]*"))
    assert len(files) >= 4
    for f in files:
        sc = load_scenario(f)
        assert sc.batch >= 1 and load_scenario(sc.to_dict()) == sc
