"""The acceptance models and token oracles of reference/acceptance.py (docs/simulator.md
"Acceptance models" and "Acceptance models and token oracles"): the integer keying against an
independent pure-Python splitmix64 (anchored on its published outputs), the thresholds at
p = 0, p = 1 and a draw equal to its threshold, each model's counts against a brute-force walk
and its distribution, int64 counts from every model (also for an empty batch), the counts'
independence of batch mates and row order, the file model's k-th verify, `build_model` /
`build_oracle` for every model name, the factory and file refusals word for word, the model
oracle's token streams, and the `CheckedOracle` contract at its edges. The custom oracles the
factory tests load are in conformance/helpers.py.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import M64
from raggedspec.conformance.helpers import splitmix64_int as sm
from raggedspec.reference.acceptance import (
    SALT_ACCEPT,
    SALT_RATE,
    SALT_TOKEN,
    SALT_WRONG,
    AllAccept,
    AllReject,
    CheckedOracle,
    FileStream,
    Geometric,
    Heterogeneous,
    ModelOracle,
    OracleAcceptance,
    OracleError,
    Profile,
    build_model,
    build_oracle,
    key_hash,
    load_accept_file,
    resolve_factory,
    splitmix64,
    threshold,
)
from raggedspec.reference.errors import ScenarioError
from raggedspec.reference.plugins import PluginError
from raggedspec.reference.scenario import AcceptanceSpec, load_scenario, parse_acceptance
from raggedspec.reference.step import verify_proposed

ORACLES = "raggedspec.conformance.helpers"  # the module holding the custom token oracles


# ------------------------------------------------------------------------------------------ keying


def pure_hash(seed: int, salt: int, seq: int, pos: int) -> int:
    """key_hash's documented composition, in Python ints."""
    return sm(sm(sm((seed * 0x100000001B3 + salt) & M64) ^ seq) ^ pos)


@pytest.mark.rule("randomness keyed by (seed, seq, position), not by row")
def test_splitmix64_is_the_published_generator():
    assert sm(0) == 0xE220A8397B1DCDAF and sm(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    xs = [0, 1, 2, 0x9E3779B97F4A7C15, 12345, M64, 1 << 63, 0xDEADBEEF]
    assert splitmix64(np.array(xs, dtype=np.uint64)).tolist() == [sm(x) for x in xs]
    assert splitmix64([0, 7]).tolist() == [sm(0), sm(7)]  # Python ints are read as uint64
    assert splitmix64(np.array([3], dtype=np.uint64)).dtype == np.uint64


@pytest.mark.rule("randomness keyed by (seed, seq, position), not by row")
@pytest.mark.parametrize("seed, salt", [(0, 0), (0, SALT_ACCEPT), (7, SALT_TOKEN),
                                        (12345, SALT_WRONG), (2**40 + 3, SALT_RATE)])
def test_key_hash_is_the_documented_composition(seed, salt):
    seqs, pos = np.array([0, 1, 5, 999]), np.array([0, 3, 4096, 2**31 - 1])
    got = key_hash(seed, salt, seqs[:, None], pos[None, :])
    assert got.shape == (4, 4) and got.dtype == np.uint64
    assert got.tolist() == [[pure_hash(seed, salt, int(s), int(p)) for p in pos] for s in seqs]


@pytest.mark.rule("acceptance models, integer and seeded")
def test_threshold_is_round_p_times_2_pow_32_on_the_closed_unit_interval():
    assert (threshold(0.0), threshold(1.0), threshold(0.5)) == (0, 1 << 32, 1 << 31)
    assert threshold(0) == 0 and threshold(1) == 1 << 32
    for p in (-0.01, 1.5, 2.0):
        with pytest.raises(ValueError) as err:
            threshold(p)
        assert str(err.value) == f"probability {p} must be in [0, 1]"


def draw(seed, seq, pos) -> int:
    return pure_hash(seed, SALT_ACCEPT, seq, pos) >> 32


@pytest.mark.rule("acceptance models, integer and seeded")
def test_a_draft_is_right_iff_its_draw_is_below_the_threshold():
    """A draw equal to the threshold is wrong; p = 1 always passes, p = 0 never does."""
    seed, seq, pos = 4, 11, 40
    d = draw(seed, seq, pos)
    assert Profile([d / 2**32], seed).accept_one(seq, pos, 1) == 0
    assert Profile([(d + 1) / 2**32], seed).accept_one(seq, pos, 1) == 1
    assert Geometric(1.0, seed).accept_one(seq, pos, 8) == 8
    assert Geometric(0.0, seed).accept_one(seq, pos, 8) == 0


@pytest.mark.rule("acceptance models, integer and seeded")
def test_the_heterogeneous_range_draw_is_the_documented_one():
    lo, hi = threshold(0.25), threshold(0.75)
    seqs = np.arange(50)
    want = [lo + pure_hash(9, SALT_RATE, int(s), 0) % (hi - lo + 1) for s in seqs]
    h = Heterogeneous([], 9, (0.25, 0.75))
    assert h.per_sequence_threshold(seqs).tolist() == want
    t = h.thresholds(seqs)
    assert t.dtype == np.int64 and t.shape == (50, 8) and (t == np.array(want)[:, None]).all()
    one = Heterogeneous([], 9, (0.5, 0.5)).per_sequence_threshold(seqs)
    assert one.tolist() == [threshold(0.5)] * 50
    two = Heterogeneous([], 9, (0.5, 0.5 + 1 / 2**32)).per_sequence_threshold(np.arange(200))
    assert set(two.tolist()) == {threshold(0.5), threshold(0.5) + 1}
    cyc = Heterogeneous([0.1, 0.2, 0.3], 0).thresholds(np.array([0, 1, 2, 3, 7]))
    assert cyc[:, 0].tolist() == [threshold(p) for p in (0.1, 0.2, 0.3, 0.1, 0.2)]


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


# -------------------------------------------------------------------------------- the count models


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


MODELS = [Geometric(0.6, 1), Profile([0.9, 0.2], 1), Heterogeneous([0.3, 0.8], 1),
          Heterogeneous([], 1, (0.2, 0.9)), AllAccept(), AllReject(), FileStream([2, 0, 5])]


@pytest.mark.rule("acceptance models, integer and seeded")
@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_every_model_returns_int64_counts_in_0_n_also_for_an_empty_batch(model):
    n = np.array([0, 1, 3, 8, 8, 0])
    a = model.accepted(np.arange(6), np.arange(6) * 7, n, np.arange(6))
    assert a.dtype == np.int64 and a.shape == (6,) and ((a >= 0) & (a <= n)).all()
    zero = model.accepted([1, 2], [3, 4], [0, 0], [0, 0])
    assert zero.dtype == np.int64 and zero.tolist() == [0, 0]
    empty = model.accepted([], [], [], [])
    assert empty.dtype == np.int64 and empty.shape == (0,)
    assert type(model.accept_one(3, 9, 2)) is int


@pytest.mark.rule("acceptance models, integer and seeded")
@pytest.mark.parametrize("n", [[-1], [9], [3, -2]])
def test_a_draft_count_outside_0_8_is_refused(n):
    with pytest.raises(ValueError) as err:
        Geometric(0.5, 0).accepted([0] * len(n), [0] * len(n), n)
    assert str(err.value) == f"drafts {n} must be in 0..=8"


@pytest.mark.rule("acceptance models, integer and seeded")
def test_a_profile_needs_a_probability():
    with pytest.raises(ValueError) as err:
        Profile([], 0)
    assert str(err.value) == "a profile needs at least one probability"


@pytest.mark.rule("acceptance models, integer and seeded")
def test_the_file_model_takes_entry_k_mod_len_clamped_to_n():
    f = FileStream({"default": [1], "2": [3, 0, 5]})
    assert f.accept_one(2, 0, 8) == 3 and f.accept_one(2, 0, 8, k=1) == 0
    assert f.accept_one(2, 0, 8, 2) == 5 and f.accept_one(2, 0, 4, 5) == 4
    assert f.accepted([2, 2], [0, 0], [8, 8]).tolist() == [3, 3]  # k defaults to 0
    assert f.accept_one(9, 0, 8, 4) == 1
    with pytest.raises(ValueError) as err:
        FileStream({"0": [1]}).accepted([5], [0], [2], [0])
    assert str(err.value) == "no accept counts for sequence 5 and no default"


@pytest.mark.rule("acceptance models, integer and seeded")
@pytest.mark.parametrize("data, message", [
    ({}, 'an accept-count file holds a list or {"default": [...], ...}'),
    (5, 'an accept-count file holds a list or {"default": [...], ...}'),
    ({"a1": [1]}, "accept-count key 'a1' must be \"default\" or a sequence id (a non-negative "
                  "integer)"),
    ({"default": [1.0]}, "accept counts for 'default' must be a non-empty list of integers >= 0,"
                         " got [1.0]"),
])
def test_a_malformed_accept_stream_is_refused_word_for_word(data, message):
    with pytest.raises(ValueError) as err:
        FileStream(data)
    assert str(err.value) == message


def where(path) -> str:
    return f"scenario key 'acceptance.path': accept-count file {str(path)!r}"


@pytest.mark.rule("acceptance models, integer and seeded")
def test_the_accept_file_refusals_name_the_file_and_what_is_wrong(tmp_path):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b"[1, \xff]")
    with pytest.raises(ScenarioError) as err:
        load_accept_file(bad)
    assert str(err.value).startswith(f"{where(bad)} cannot be read: ")
    assert "decode" in str(err.value)
    notjson = tmp_path / "n.json"
    notjson.write_text("[1,")
    with pytest.raises(ScenarioError) as err:
        load_accept_file(notjson)
    assert str(err.value).startswith(f"{where(notjson)} is not valid JSON (")
    assert str(err.value).endswith(
        '); expected a list of accept counts or {"default": [...], "<seq id>": [...]}')
    negative = tmp_path / "neg.json"
    negative.write_text("[1, -1]")
    with pytest.raises(ScenarioError) as err:
        load_accept_file(negative)
    assert str(err.value) == (f"{where(negative)}: accept counts for 'default' must be a "
                              "non-empty list of integers >= 0, got [1, -1]")
    per_seq = tmp_path / "p.json"
    per_seq.write_text(json.dumps({"1": [2]}))
    assert load_accept_file(per_seq).lists == {"1": [2]}  # no n_seqs: nothing to cover
    default = tmp_path / "d.json"
    default.write_text(json.dumps({"default": [1], "3": [0]}))
    assert load_accept_file(default, 10).lists == {"default": [1], "3": [0]}
    for n, shown in [(9, "[0, 2, 3, 4, 5, 6, 7, 8]"), (10, "[0, 2, 3, 4, 5, 6, 7, 8] ..."),
                     (11, "[0, 2, 3, 4, 5, 6, 7, 8] ...")]:
        with pytest.raises(ScenarioError) as err:
            load_accept_file(per_seq, n)
        assert str(err.value) == (f'{where(per_seq)} has no "default" list and no list for '
                                  f"sequence(s) {shown} (the scenario has {n} requests)")


# ---------------------------------------------------------------------- build_model / build_oracle


@pytest.mark.rule("acceptance models, integer and seeded")
@pytest.mark.parametrize("text, cls", [("geometric:0.3", Geometric), ("profile:0.9,0.4", Profile),
                                       ("heterogeneous:0.2,0.7", Heterogeneous),
                                       ("all-accept", AllAccept), ("all-reject", AllReject)])
def test_build_model_makes_each_named_model_with_its_probabilities_and_seed(text, cls):
    spec = parse_acceptance(text)
    m = build_model(spec, 17)
    assert type(m) is cls
    ref = {"geometric": lambda: Geometric(0.3, 17), "profile": lambda: Profile([0.9, 0.4], 17),
           "heterogeneous": lambda: Heterogeneous([0.2, 0.7], 17), "all-accept": AllAccept,
           "all-reject": AllReject}[spec.model]()
    seqs, pos, n = np.arange(300) % 13, np.arange(300) * 3, np.full(300, 4)
    assert m.accepted(seqs, pos, n, 0).tolist() == ref.accepted(seqs, pos, n, 0).tolist()
    if cls is not AllAccept and cls is not AllReject:
        assert m.seed == 17 and not (m.accepted(seqs, pos, n, 0) == AllReject().accepted(
            seqs, pos, n, 0)).all()


@pytest.mark.rule("acceptance models, integer and seeded")
def test_build_model_draws_a_heterogeneous_range_and_reads_the_file(tmp_path):
    spec = parse_acceptance({"model": "heterogeneous", "p_range": [0.3, 0.6]})
    m = build_model(spec, 2)
    assert m.seed == 2 and m.range == (threshold(0.3), threshold(0.6))
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"0": [2], "1": [1]}))
    spec = parse_acceptance(f"file:{path}")
    f = build_model(spec, 0)  # no scenario: no coverage to check
    assert isinstance(f, FileStream) and f.lists == {"0": [2], "1": [1]}
    assert build_model(spec, 0, load_scenario({"batch": 2})).lists == f.lists
    with pytest.raises(ScenarioError, match=r"sequence\(s\) \[2\] \(the scenario has 3 requests"):
        build_model(spec, 0, _scenario_of_batch(3, spec))
    with pytest.raises(ValueError) as err:
        build_model(AcceptanceSpec("sometimes"), 0)
    assert str(err.value) == "unknown acceptance model 'sometimes'"


def _scenario_of_batch(b, spec):
    """A scenario object with `batch` b and the given acceptance, built without the load-time
    file check (which would refuse it first)."""
    from dataclasses import replace

    return replace(load_scenario({"batch": b}), acceptance=spec)


FACTORY = f"{ORACLES}:make_recorder"


@pytest.mark.rule("pluggable token oracle")
def test_the_oracle_factory_gets_the_scenario_and_the_checked_oracle_passes_calls_through():
    sc = load_scenario({"acceptance": f"oracle:{FACTORY}"})
    model = build_model(sc.acceptance, sc.seed, sc)
    assert isinstance(model, OracleAcceptance) and model.name == FACTORY
    assert model.oracle.scenario is sc
    with pytest.raises(TypeError) as err:
        model.accepted([0], [0], [1], [0])
    assert str(err.value) == (
        "a custom token oracle has no token-free accept count; verify its tokens")
    oracle = build_oracle(model, 3, 16)
    assert isinstance(oracle, CheckedOracle) and oracle.name == FACTORY and oracle.vocab == 16
    assert oracle.prompt(4, 2) == [0, 0] and oracle.target(5, [1, 2]) == 0
    assert oracle.draft(6, [1], 3) == [0, 0, 0]
    assert model.oracle.calls == [("prompt", 4, 2), ("target", 5, [1, 2]), ("draft", 6, [1], 3)]
    assert OracleAcceptance(model.oracle).name == "custom oracle"



@pytest.mark.rule("pluggable token oracle")
def test_a_factory_result_without_the_methods_is_refused_word_for_word():
    sc = load_scenario({"acceptance": f"oracle:{ORACLES}:make_nothing"})
    with pytest.raises(ScenarioError) as err:
        build_model(sc.acceptance, 0, sc)
    assert str(err.value) == (
        f"scenario key 'acceptance.factory': '{ORACLES}:make_nothing'"
        " returned None, which has no callable prompt, target, draft; a TokenOracle needs "
        "prompt(seq_id, length), target(seq_id, context) and draft(seq_id, context, n)")



@pytest.mark.rule("pluggable token oracle")
def test_a_factory_whose_result_is_not_an_oracle_is_a_scenario_error():
    sc = load_scenario({"acceptance": f"oracle:{ORACLES}:make_not_an_oracle"})
    with pytest.raises(ScenarioError) as err:
        build_model(sc.acceptance, sc.seed, sc)
    assert "'acceptance.factory'" in str(err.value)
    for w in ["make_not_an_oracle", "no callable prompt, target, draft"]:
        assert w in str(err.value)


@pytest.mark.rule("pluggable token oracle")
def test_a_factory_that_raises_is_the_oracles_failure_not_a_scenario_error():
    """The factory's own exception is kept (a PluginError caused by it), so the command
    reports it with its traceback as raised by the user's oracle."""
    spec = f"{ORACLES}:make_raising"
    sc = load_scenario({"acceptance": f"oracle:{spec}"})
    with pytest.raises(PluginError) as err:
        build_model(sc.acceptance, sc.seed, sc)
    assert str(err.value) == f"raised by your oracle {spec!r} when called with the scenario"
    assert isinstance(err.value.__cause__, RuntimeError)
    assert "weights are missing" in str(err.value.__cause__)



@pytest.mark.rule("pluggable token oracle")
def test_a_custom_token_oracle_loads_from_a_factory():
    sc = load_scenario({"acceptance": f"oracle:{ORACLES}:make_oracle"})
    model = build_model(sc.acceptance, sc.seed, sc)
    assert model.needs_tokens
    oracle = build_oracle(model, 0, 64)
    # the factory string imports this module under its installed name, which may be a second
    # copy of the module pytest imported: compare the class by name
    assert isinstance(oracle, CheckedOracle)
    assert type(oracle.oracle).__qualname__ == "_ConstantOracle"
    assert oracle.draft(0, [1, 1], 3) == [1, 1, 2] and oracle.target(0, [1]) == 1



@pytest.mark.rule("pluggable token oracle")
def test_build_oracle_turns_a_count_model_into_its_model_oracle():
    m = Geometric(0.5, 8)
    o = build_oracle(m, 8, 16)
    assert type(o) is ModelOracle and o.model is m and (o.seed, o.vocab) == (8, 16)


# --------------------------------------------------------------------------------- resolve_factory


@pytest.mark.rule("pluggable token oracle")
def test_resolve_factory_refusals_word_for_word(tmp_path, monkeypatch):
    w = "scenario key 'acceptance.factory': "
    for bad in (None, "", "os", "os:", ":sep"):
        with pytest.raises(ScenarioError) as err:
            resolve_factory(bad)
        assert str(err.value) == (
            f"{w}{bad!r} must be 'module:callable', e.g. oracle:my_module:make_oracle")
    with pytest.raises(ScenarioError) as err:
        resolve_factory("os:path:sep")  # the first colon splits
    assert str(err.value) == f"{w}'os:path:sep': module 'os' has no attribute 'path:sep'"
    with pytest.raises(ScenarioError) as err:
        resolve_factory("os:sep")
    assert str(err.value) == (
        f"{w}'os:sep': os.sep is not callable (it is a str: {__import__('os').sep!r}); it must be"
        " a function or class taking the Scenario and returning a TokenOracle")
    (tmp_path / "rs_boom_oracle.py").write_text("raise RuntimeError('no weights')\n")
    (tmp_path / "rs_fine_oracle.py").write_text("def make(scenario):\n    return scenario\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "rs_boom_oracle", raising=False)
    with pytest.raises(PluginError) as err:  # the oracle's own failure, not a bad name
        resolve_factory("rs_boom_oracle:make")
    assert str(err.value) == "raised by your oracle 'rs_boom_oracle:make' while importing"
    assert str(err.value.__cause__) == "no weights"
    try:
        assert resolve_factory("rs_fine_oracle:make")(41) == 41  # found in the current folder
    finally:
        sys.modules.pop("rs_fine_oracle", None)
    assert str(tmp_path) not in sys.path


# -------------------------------------------------------------------------------- the model oracle


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


@pytest.mark.rule("pluggable token oracle")
def test_the_model_oracle_streams_and_counts_its_drafting_verifies():
    """prompt = the true stream from 0; target = the true token at len(context); the k-th
    draft with n > 0 (k from 0, n = 0 not counted) takes the file model's entry k."""
    o = ModelOracle(FileStream([0, 1, 2]), 5, 16)
    prompt = o.prompt(3, 6)
    assert prompt == [pure_hash(5, SALT_TOKEN, 3, i) % 16 for i in range(6)]
    assert [o.target(3, prompt[:i]) for i in range(6)] == prompt
    assert o.draft(3, prompt, 0) == [] and o.verifies == {}
    got = []
    for _ in range(4):
        drafts = o.draft(3, prompt, 3)
        true = o.true_tokens(3, 6, 3)
        got.append(next((j for j in range(3) if drafts[j] != true[j]), 3))
    assert got == [0, 1, 2, 0] and o.verifies == {3: 4}
    assert o.draft(4, prompt, 3)[0] != o.true_tokens(4, 6, 1)[0]  # its own k = 0


@pytest.mark.rule("pluggable token oracle")
def test_the_wrong_token_is_the_documented_shift_of_the_true_one():
    for vocab in (2, 3, 16):
        o = ModelOracle(AllReject(), 7, vocab)
        for k in range(60):
            true = pure_hash(7, SALT_TOKEN, 2, k) % vocab
            shift = 1 + pure_hash(7, SALT_WRONG, 2, k) % (vocab - 1)
            w = o.wrong_token(2, k)
            assert type(w) is int and w == (true + shift) % vocab and w != true
    o = ModelOracle(AllReject(), 7, 3)
    assert {(o.wrong_token(2, k) - o.true_tokens(2, k, 1)[0]) % 3 for k in range(60)} == {1, 2}
    with pytest.raises(ValueError) as err:
        ModelOracle(AllAccept(), 0, 1)
    assert str(err.value) == "vocab 1 must be >= 2 for a wrong draft to exist"


# ------------------------------------------------------------------------------ the checked oracle


class _Fixed:
    """An oracle returning fixed results."""

    def __init__(self, prompt=None, target=0, draft=None):
        self.p, self.t, self.d = prompt, target, draft

    def prompt(self, seq_id, length):
        return self.p

    def target(self, seq_id, context):
        return self.t

    def draft(self, seq_id, context, n):
        return self.d


@pytest.mark.rule("pluggable token oracle")
def test_the_checked_oracle_accepts_tokens_0_to_vocab_minus_1():
    o = CheckedOracle(_Fixed(prompt=[0, 3], target=0, draft=[3, 0]), 4)
    assert o.prompt(0, 2) == [0, 3] and o.target(0, []) == 0 and o.draft(0, [], 2) == [3, 0]
    assert type(CheckedOracle(_Fixed(target=np.int32(3)), 4).target(0, [])) is int
    assert CheckedOracle(_Fixed(draft=[]), 4).draft(0, [1], 0) == []
    assert type(CheckedOracle(_Fixed(target=np.int64(3)), 4).target(0, [])) is int


@pytest.mark.rule("pluggable token oracle")
@pytest.mark.parametrize("call, oracle, text", [
    (lambda o: o.draft(1, [5, 5], 2), _Fixed(draft=None),
     "draft(seq_id=1, context of 2 tokens, n=2) returned None; it must return a list of exactly "
     "2 token(s)"),
    (lambda o: o.draft(0, [], 1), _Fixed(draft=5),
     "draft(seq_id=0, context of 0 tokens, n=1) returned 5; it must return a list of exactly "
     "1 token(s)"),
    (lambda o: o.draft(2, [1, 1], 3), _Fixed(draft=[1, 1]),
     "draft(seq_id=2, context of 2 tokens, n=3) returned [1, 1]; it must return exactly 3 "
     "token(s) (got 2)"),
    (lambda o: o.draft(0, [], 2), _Fixed(draft=[1, -1]),
     "draft(seq_id=0, context of 0 tokens, n=2) returned [1, -1]; it must return exactly 2 "
     "token(s) (got 2)"),
    (lambda o: o.target(0, []), _Fixed(target=True),
     "target(seq_id=0, context of 0 tokens) returned True; it must return one token"),
    (lambda o: o.draft(0, [], 2), _Fixed(draft=[0, 4]),
     "draft(seq_id=0, context of 0 tokens, n=2) returned [0, 4]; it must return exactly 2 "
     "token(s) (got 2)"),
    (lambda o: o.target(2, [1]), _Fixed(target=4),
     "target(seq_id=2, context of 1 tokens) returned 4; it must return one token"),
    (lambda o: o.target(2, [1]), _Fixed(target=-1),
     "target(seq_id=2, context of 1 tokens) returned -1; it must return one token"),
    (lambda o: o.prompt(0, 4), _Fixed(prompt=[1] * 13),
     "prompt(seq_id=0, length=4) returned [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, '...']; it must "
     "return exactly 4 token(s) (got 13)"),
    (lambda o: o.prompt(0, 4), _Fixed(prompt=[1] * 12),
     "prompt(seq_id=0, length=4) returned [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]; it must return "
     "exactly 4 token(s) (got 12)"),
])
def test_a_breach_is_refused_word_for_word(call, oracle, text):
    with pytest.raises(OracleError) as err:
        call(CheckedOracle(oracle, 4))
    assert isinstance(err.value, ScenarioError)
    assert str(err.value) == (
        "scenario key 'acceptance.factory': the oracle from 'custom oracle' broke the "
        f"TokenOracle contract: {text}, each token an int in [0, vocab = 4)")

