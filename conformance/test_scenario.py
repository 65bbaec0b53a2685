"""Scenarios (reference/scenario.py, docs/simulator.md "Keys, defaults and ranges"): loading
from TOML, JSON, a dict or a `Scenario`, overrides (dict and `key=value` strings, dotted keys,
nulls), `to_dict` round trips, every key's refusal word for word (`scenario key 'KEY': WHAT,
got VALUE`) and each range at its edges, the request generator's documented draw (an
independent splitmix64 anchored on its published output), the acceptance forms (shorthands and
tables both ways) and the accept files and factories checked at load time, the model table,
and the shipped example scenarios.

The custom token oracles that scenarios name by `oracle:module:factory` are in
conformance/helpers.py (`raggedspec.conformance.helpers:make_oracle`, ...).
"""

from __future__ import annotations

import json

import pytest

from raggedspec.conformance.helpers import make_short_drafter  # noqa: F401  (test_cli.py names it here)
from raggedspec.conformance.helpers import splitmix64_int as sm
from raggedspec.reference.errors import ScenarioError
from raggedspec.reference.scenario import (
    AcceptanceSpec,
    Request,
    Scenario,
    acceptance_table,
    generate_requests,
    load_scenario,
    model_config,
    parse_acceptance,
)


def refused(data=None, overrides=None) -> str:
    with pytest.raises(ScenarioError) as err:
        load_scenario(data, overrides)
    return str(err.value)


def key(k: str, what: str, got) -> str:
    return f"scenario key '{k}': {what}, got {got!r}"


# ------------------------------------------------------------------------- loading and round trips


@pytest.mark.rule("scenario config and validation")
def test_defaults_load_and_round_trip_through_to_dict():
    sc = load_scenario()
    assert sc.batch == 8 and sc.depth == 3
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


@pytest.mark.rule("scenario config and validation")
def test_the_sources_a_scenario_is_read_from(tmp_path):
    sc = load_scenario({"batch": 2, "depth": 1})
    assert load_scenario(sc) == sc
    data = {"batch": 2}
    load_scenario(data, {"depth": 2})
    assert data == {"batch": 2}  # the caller's dict is not changed
    js = tmp_path / "s.JSON"
    js.write_text(json.dumps({"batch": 2, "depth": 1}))
    assert load_scenario(js) == sc
    assert load_scenario(str(js)) == sc
    toml = tmp_path / "s.toml"
    toml.write_text("batch = 2\ndepth = 1\n")
    assert load_scenario(toml) == sc
    bad_json = tmp_path / "b.json"
    bad_json.write_text("{")
    assert refused(bad_json).startswith(f"scenario file {bad_json} is not valid JSON: ")
    bad_toml = tmp_path / "b.toml"
    bad_toml.write_text("batch = = 2")
    assert refused(bad_toml).startswith(f"scenario file {bad_toml} is not valid TOML: ")
    latin = tmp_path / "l.toml"
    latin.write_bytes(b"# caf\xe9\nbatch = 2\n")
    assert refused(latin) == (f"scenario file {latin} is not UTF-8 text (byte 5: invalid "
                              "continuation byte); save it as UTF-8 TOML or JSON")
    assert refused(tmp_path) == f"scenario file {tmp_path} does not exist"
    listed = tmp_path / "l.json"
    listed.write_text("[1, 2]")
    assert refused(listed) == "a scenario must be a table of keys, got list"


@pytest.mark.rule("scenario config and validation")
def test_a_file_that_cannot_be_read_is_a_scenario_error(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    path = tmp_path / "s.toml"
    path.write_text("batch = 2\n")

    def denied(self):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert refused(path) == f"scenario file {path} cannot be read: Permission denied"


@pytest.mark.rule("scenario config and validation")
def test_a_missing_file_is_a_scenario_error(tmp_path):
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario(tmp_path / "nope.toml")


@pytest.mark.rule("scenario config and validation")
def test_a_scenario_is_frozen_and_its_batch_is_its_request_count():
    sc = load_scenario({"requests": [{"prompt_len": 2}, {"prompt_len": 3}]})
    assert isinstance(sc, Scenario) and sc.batch == 2
    with pytest.raises(AttributeError):
        sc.depth = 1



@pytest.mark.rule("advance request vs flags and the refusal chain")
def test_per_sequence_advance_sets_the_flag_it_stands_for():
    assert load_scenario({"advance": "per-sequence"}).per_seq_kv is True
    assert load_scenario({"advance": "cohort"}).per_seq_kv is False


@pytest.mark.rule("scenario config and validation")
def test_the_example_scenarios_load():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.[tj][os][mo]*"))
    assert len(files) >= 4
    for f in files:
        sc = load_scenario(f)
        assert sc.batch >= 1 and load_scenario(sc.to_dict()) == sc


# --------------------------------------------------------------------------- the request generator


@pytest.mark.rule("request generator")
def test_the_generator_draws_each_length_by_the_documented_hash():
    assert sm(0) == 0xE220A8397B1DCDAF  # the published first output for state 0

    def draw(seed, i, salt, lo, hi):
        return lo if lo == hi else lo + sm(sm(sm(seed ^ salt) ^ i)) % (hi - lo + 1)

    gen = {"batch": 30, "prompt_len": (3, 40), "max_new_tokens": (1, 9),
           "arrival": "all-at-once", "stagger": 1}
    for seed in (0, 5, 2**40):
        assert generate_requests(gen, seed) == tuple(
            Request(draw(seed, i, 0x5052, 3, 40), draw(seed, i, 0x4D4E, 1, 9), 0)
            for i in range(30))
    fixed = generate_requests({**gen, "prompt_len": (7, 7), "max_new_tokens": (2, 2),
                               "arrival": "staggered", "stagger": 4}, 1)
    assert fixed == tuple(Request(7, 2, 4 * i) for i in range(30))
    sc = load_scenario({"batch": 3, "prompt_len": [3, 40], "max_new_tokens": [1, 9], "seed": 5})
    assert sc.requests == generate_requests({**gen, "batch": 3}, 5)
    assert sc.to_dict()["prompt_len"] == [3, 40] and sc.to_dict()["batch"] == 3


@pytest.mark.rule("request generator")
def test_the_generator_defaults():
    """docs/simulator.md: batch 8, prompt_len 16, max_new_tokens 256, all at once; a
    staggered arrival defaults to one step apart."""
    sc = load_scenario({})
    assert sc.requests == (Request(16, 256, 0, True),) * 8
    assert sc.generator == {"batch": 8, "prompt_len": [16, 16], "max_new_tokens": [256, 256],
                            "arrival": "all-at-once", "stagger": 1}
    st = load_scenario({"arrival": "staggered", "batch": 3})
    assert [r.arrival for r in st.requests] == [0, 1, 2]


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


# ----------------------------------------------------------------------- keys, ranges and refusals


@pytest.mark.rule("scenario config and validation")
@pytest.mark.parametrize("data, message", [
    ({"bogus": 1}, key("bogus", "unknown key; allowed keys: requests, batch, prompt_len, "
                       "max_new_tokens, arrival, stagger, depth, max_seq_len, advance, world, "
                       "admission, strip, per_seq_kv, xs_per_seq, max_seqs, max_draft_kv_seqs, "
                       "prefill_floor, prefill_max_seqs, acceptance, model, seed, steps", 1)),
    ({"depth": 9}, key("depth", "must be an integer in 0..=8", 9)),
    ({"depth": 2.0}, key("depth", "must be an integer in 0..=8", 2.0)),
    ({"depth": True}, key("depth", "must be an integer in 0..=8", True)),
    ({"batch": 2**20 + 1}, key("batch", "must be an integer in 1..=1048576", 2**20 + 1)),
    ({"seed": -1}, key("seed", "must be an integer in 0..=18446744073709551615", -1)),
    ({"seed": 2**64}, key("seed", "must be an integer in 0..=18446744073709551615", 2**64)),
    ({"stagger": 0}, key("stagger", "must be an integer >= 1", 0)),
    ({"steps": 10_000_001}, key("steps", "must be an integer in 1..=10000000", 10_000_001)),
    ({"max_seqs": 0}, key("max_seqs", "must be an integer >= 1", 0)),
    ({"prefill_max_seqs": "2"}, key("prefill_max_seqs", "must be an integer >= 1", "2")),
    ({"prefill_floor": -1}, key("prefill_floor", "must be an integer >= 0", -1)),
    ({"prompt_len": [1, 2, 3]}, key("prompt_len", "must be an integer >= 1 or an inclusive "
                                    "[low, high] pair", [1, 2, 3])),
    ({"prompt_len": [5, 4]}, key("prompt_len", "range [low, high] must have low <= high", [5, 4])),
    ({"max_new_tokens": [0, 4]}, key("max_new_tokens", "must be an integer >= 1", 0)),
    ({"prompt_len": [4, 0]}, key("prompt_len", "must be an integer >= 1", 0)),
    ({"prompt_len": [4, "5"]}, key("prompt_len", "must be an integer >= 1", "5")),
    ({"per_seq_kv": "yes"}, key("per_seq_kv", "must be true or false", "yes")),
    ({"prompt_len": 10, "max_seq_len": 10},
     key("prompt_len", "must be at most max_seq_len - 1 = 9", 10)),
    ({"max_seq_len": 10}, key("prompt_len", "must be at most max_seq_len - 1 = 9", 16)),
    ({"arrival": "later"}, key("arrival", "must be one of all-at-once, staggered", "later")),
    ({"advance": "ragged"}, key("advance", "must be one of cohort, per-sequence", "ragged")),
    ({"world": "W9"}, key("world", "must be one of W0, WA, WB", "W9")),
    ({"admission": 1}, key("admission", "must be one of refuse, grant", 1)),
    ({"strip": "x"}, key("strip", "must be one of eager, lazy, none", "x")),
    ({"xs_per_seq": 1}, key("xs_per_seq", "must be true or false", 1)),
    ({"per_seq_kv": True}, key("per_seq_kv", "is the ARC_MTP_PER_SEQ_KV request and must equal "
                               "(advance == 'per-sequence') = False", True)),
    ({"advance": "per-sequence", "per_seq_kv": False},
     key("per_seq_kv", "is the ARC_MTP_PER_SEQ_KV request and must equal (advance == "
         "'per-sequence') = True", False)),
    ({"requests": []}, key("requests", "must be a non-empty list of {prompt_len, max_new_tokens, "
                           "arrival}", [])),
    ({"requests": {"prompt_len": 3}}, key("requests", "must be a non-empty list of {prompt_len, "
                                          "max_new_tokens, arrival}", {"prompt_len": 3})),
    ({"requests": [5]}, key("requests[0]", "must be a table {prompt_len, max_new_tokens, "
                            "arrival, may_draft}", 5)),
    ({"requests": [{"prompt_len": 3, "x": 1, "a": 2}]},
     key("requests[0].a", "unknown key; allowed: prompt_len, max_new_tokens, arrival, "
         "may_draft", 2)),
    ({"requests": [{"prompt_len": 3}], "stagger": 2},
     key("stagger", "cannot be combined with an explicit requests list", 2)),
    ({"requests": [{"prompt_len": 4096}]},
     key("requests[0].prompt_len", "must be an integer in 1..=4095", 4096)),
    ({"requests": [{}]}, key("requests[0].prompt_len", "must be an integer in 1..=4095", None)),
    ({"requests": [{"prompt_len": 3}, {"prompt_len": 3, "max_new_tokens": 0}]},
     key("requests[1].max_new_tokens", "must be an integer >= 1", 0)),
    ({"requests": [{"prompt_len": 3, "arrival": -1}]},
     key("requests[0].arrival", "must be an integer >= 0", -1)),
    ({"requests": [{"prompt_len": 3, "may_draft": 0}]},
     key("requests[0].may_draft", "must be true or false", 0)),
    ({"model": [1]}, key("model", "must be a table of vocab, hidden, n_heads, n_kv_heads, "
                         "head_dim, rope_dims, compress_ratios, sliding_window, seed, mtp", [1])),
    ({"model": {"depth": 1}}, key("model.depth", "unknown key; allowed: vocab, hidden, n_heads, "
                                  "n_kv_heads, head_dim, rope_dims, compress_ratios, "
                                  "sliding_window, seed, mtp", 1)),
    ({"model": {"vocab": 1}}, "scenario key 'model.vocab': must be >= 2, got 1"),
    ({"model": {"mtp": "tail"}}, key("model.mtp", "must be one of block, heads", "tail")),
    ({"model": {"colours": 1}}, key("model.colours", "unknown key; allowed: vocab, hidden, "
                                    "n_heads, n_kv_heads, head_dim, rope_dims, compress_ratios, "
                                    "sliding_window, seed, mtp", 1)),
])
def test_each_refusal_names_the_key_what_it_must_be_and_the_value(data, message):
    assert refused(data) == message


@pytest.mark.rule("scenario config and validation")
@pytest.mark.parametrize("data, key, words", [
    ({"batch": 0}, "batch", "1..="),
    ({"depth": -1}, "depth", "0..=8"),
    ({"prompt_len": -3}, "prompt_len", ">= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens", ">= 1"),
    ({"max_seq_len": 1}, "max_seq_len", "in 2..=2147483647"),
    ({"max_seq_len": 2**31}, "max_seq_len", "in 2..=2147483647"),
    ({"steps": 0}, "steps", "1..="),
    ({"requests": [{"prompt_len": 4}], "batch": 2}, "batch", "explicit requests list"),
    ({"requests": [{"prompt_len": 0}]}, "requests[0].prompt_len", "1..="),
    ({"acceptance": "geometric:1.5"}, "acceptance.p", "[0, 1]"),
    ({"acceptance": "sometimes"}, "acceptance.model", "geometric"),
    ({"model": {"n_heads": 4, "n_kv_heads": 3}}, "model", "n_kv_heads 3 must be >= 1 and divide"),
    ({"max_draft_kv_seqs": 0}, "max_draft_kv_seqs", ">= 1"),
])
def test_a_bad_scenario_names_the_key_and_the_allowed_range(data, key, words):
    with pytest.raises(ScenarioError) as err:
        load_scenario(data)
    assert f"'{key}'" in str(err.value) and words in str(err.value)
    assert isinstance(err.value, ValueError)



@pytest.mark.rule("scenario config and validation")
@pytest.mark.parametrize("data", [
    {"depth": 0}, {"depth": 8}, {"batch": 1}, {"max_seq_len": 2, "prompt_len": 1},
    {"max_seq_len": 2**31 - 1}, {"prompt_len": 4095},
    {"steps": 1}, {"steps": 10_000_000}, {"seed": 0}, {"stagger": 1, "arrival": "staggered"},
    {"requests": [{"prompt_len": 4095, "max_new_tokens": 1, "arrival": 0}]},
    {"max_seqs": 1, "prefill_max_seqs": 1, "max_draft_kv_seqs": 1},
])
def test_each_range_holds_its_edges(data):
    load_scenario(data)


@pytest.mark.rule("scenario config and validation")
def test_nullable_keys_and_the_prefill_floor():
    sc = load_scenario({"max_seqs": None, "max_draft_kv_seqs": None, "prefill_max_seqs": None})
    assert (sc.max_seqs, sc.max_draft_kv_seqs, sc.prefill_max_seqs) == (None, None, None)
    assert load_scenario({"max_seqs": 3}).max_seqs == 3
    assert load_scenario({"prefill_max_seqs": 2}).prefill_max_seqs == 2
    assert load_scenario({"max_draft_kv_seqs": 5}).max_draft_kv_seqs == 5
    assert load_scenario({}).prefill_floor == 4
    assert load_scenario({"prefill_floor": 0}).prefill_floor is None
    assert load_scenario({"prefill_floor": None}).prefill_floor is None
    assert load_scenario({"prefill_floor": 1}).prefill_floor == 1
    assert load_scenario({"model": None}).model == {}
    sc = load_scenario({"requests": [{"prompt_len": 3}], "steps": 9, "seed": 4, "depth": 0,
                        "world": "WA", "admission": "grant", "strip": "lazy",
                        "xs_per_seq": True, "max_seq_len": 64})
    assert sc.requests == (Request(3, 256, 0, True),) and sc.generator is None
    assert (sc.steps, sc.seed, sc.depth, sc.world, sc.admission, sc.strip) == (
        9, 4, 0, "WA", "grant", "lazy")
    assert sc.xs_per_seq is True and sc.max_seq_len == 64
    assert sc.to_dict()["requests"] == [
        {"prompt_len": 3, "max_new_tokens": 256, "arrival": 0, "may_draft": True}]
    assert "batch" not in sc.to_dict()



@pytest.mark.rule("scenario config and validation")
def test_the_model_config_takes_the_scenario_seed_and_length_unless_given():
    cfg = model_config(load_scenario({"seed": 3, "max_seq_len": 100}))
    assert (cfg.seed, cfg.max_seq_len, cfg.vocab, cfg.n_kv_heads) == (3, 100, 64, 1)
    cfg = model_config(load_scenario({"seed": 3, "model": {"seed": 9, "vocab": 2}}))
    assert (cfg.seed, cfg.vocab) == (9, 2)
    direct = Scenario(requests=(Request(2, 2),), model={"compress_ratios": [0, 8]})
    assert model_config(direct).compress_ratios == (0, 8)


# --------------------------------------------------------------------------------------- overrides


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


@pytest.mark.rule("scenario config and validation")
def test_overrides_as_a_dict_and_as_key_value_strings():
    sc = load_scenario({"batch": 2}, {"depth": 1, "model.vocab": 8, "seed": None})
    assert (sc.depth, sc.model, sc.seed, sc.batch) == (1, {"vocab": 8}, 0, 2)
    sc = load_scenario(None, [" depth = 2 ", "world=WA", "acceptance=all-accept",
                              "model.compress_ratios=[0, 8]", "steps=null"])
    assert (sc.depth, sc.world, sc.acceptance.model, sc.steps) == (2, "WA", "all-accept", 200)
    assert sc.model == {"compress_ratios": (0, 8)}
    assert model_config(sc).compress_ratios == (0, 8)
    assert sc.to_dict()["model"] == {"compress_ratios": [0, 8]}
    sc = load_scenario({"acceptance": "profile:0.5,0.25"}, ["acceptance.p=[0.125]"])
    assert sc.acceptance == AcceptanceSpec("profile", (0.125,))
    # a dotted key completes a table that is not valid without it, or makes a new one
    sc = load_scenario({"acceptance": {"model": "profile"}}, ["acceptance.p=[0.5]"])
    assert sc.acceptance == AcceptanceSpec("profile", (0.5,))
    assert load_scenario(None, ["acceptance.p=[0.3]"]).acceptance == AcceptanceSpec(
        "geometric", (0.3,))
    # a null value leaves the key as it is, and the overrides after it still apply
    assert load_scenario({"steps": 7}, ["steps=null", "depth=2"]).steps == 7
    assert load_scenario(None, {"seed": None, "depth": 2}).depth == 2
    # the first '=' splits: the value may hold one
    assert refused(None, ["world=W=0"]) == key("world", "must be one of W0, WA, WB", "W=0")
    assert load_scenario({"depth": 4}, []).depth == 4
    assert load_scenario({"depth": 4}, None).depth == 4
    assert load_scenario({"depth": 4}, {}).depth == 4
    for bad in (["depth"], [5]):
        assert refused(None, bad) == key("overrides", "each override must be 'key=value'", bad[0])
    assert refused(None, ["model.a.b=1"]) == key(
        "model.a.b", "overrides reach at most one table level (table.key)", 1)


# ---------------------------------------------------------------------------- the acceptance forms


@pytest.mark.rule("scenario config and validation")
@pytest.mark.parametrize("value, message", [
    ("geometric:x", key("acceptance", "probabilities must be comma-separated numbers, e.g. "
                        "geometric:0.7", "geometric:x")),
    ("profile:0.5,,0.2", key("acceptance", "probabilities must be comma-separated numbers, e.g. "
                             "profile:0.74,0.54,0.41", "profile:0.5,,0.2")),
    ("heterogeneous: ", key("acceptance", "'heterogeneous:' needs its probabilities after the "
                            "colon, e.g. heterogeneous:0.2,0.9", "heterogeneous: ")),
    ("all-reject:1", key("acceptance", "'all-reject' takes no argument", "all-reject:1")),
    (7, key("acceptance", "must be a string like geometric:0.7 or a table {model, p, ...}", 7)),
    ({"model": "geometric", "q": 1, "b": 2},
     key("acceptance.b", "unknown key; allowed: model, p, p_range, path, factory", 2)),
    ({"p": [True]}, key("acceptance.p", "must be a probability in [0, 1]", True)),
    ({"p": ["0.5"]}, key("acceptance.p", "must be a probability in [0, 1]", "0.5")),
    ({"p": [-0.1]}, key("acceptance.p", "must be a probability in [0, 1]", -0.1)),
    ({"model": "profile", "p": [0.5, 2]}, key("acceptance.p", "must be a probability in [0, 1]",
                                              2)),
    ({"model": "heterogeneous", "p": [0.5, -1]},
     key("acceptance.p", "must be a probability in [0, 1]", -1)),
    ({"p": [0.2, 0.3]}, key("acceptance.p", "geometric takes exactly one probability, e.g. "
                            "geometric:0.7", [0.2, 0.3])),
    ({"model": "profile", "p": [0.5] * 9},
     key("acceptance.p", "profile needs 1..=8 per-position probabilities (one per draft "
         "position, the last repeats), e.g. profile:0.74,0.54,0.41", [0.5] * 9)),
    ({"model": "heterogeneous", "p": [0.5]},
     key("acceptance.p", "heterogeneous needs at least two probabilities (sequence i gets "
         "p[i mod n]; for one probability for every sequence use geometric:p), e.g. "
         "heterogeneous:0.2,0.9, or a p_range = [low, high]", [0.5])),
    ({"model": "heterogeneous", "p": [0.2, 0.9], "p_range": [0.1, 0.2]},
     key("acceptance.p", "heterogeneous takes either p (a list) or p_range, not both",
         [0.2, 0.9])),
    ({"model": "geometric", "p_range": [0.1, 0.2]},
     key("acceptance.p_range", "only for heterogeneous: a [low, high] pair of probabilities",
         [0.1, 0.2])),
    ({"model": "heterogeneous", "p_range": [0.1, 0.2, 0.3]},
     key("acceptance.p_range", "only for heterogeneous: a [low, high] pair of probabilities",
         [0.1, 0.2, 0.3])),
    ({"model": "heterogeneous", "p_range": 0.5},
     key("acceptance.p_range", "only for heterogeneous: a [low, high] pair of probabilities",
         0.5)),
    ({"model": "heterogeneous", "p_range": [-0.5, 0.5]},
     key("acceptance.p_range", "must be a probability in [0, 1]", -0.5)),
    ({"model": "heterogeneous", "p_range": [0.1, 1.5]},
     key("acceptance.p_range", "must be a probability in [0, 1]", 1.5)),
    ({"model": "heterogeneous", "p_range": [0.6, 0.2]},
     key("acceptance.p_range", "must have low <= high", [0.6, 0.2])),
    ({"model": "file"}, key("acceptance.path", "the file model needs a JSON path", None)),
    ("file:", key("acceptance.path", "the file model needs a JSON path", "")),
    ({"model": "file", "path": 3}, key("acceptance.path", "the file model needs a JSON path", 3)),
    ({"model": "oracle"}, key("acceptance.factory", "the oracle model needs 'module:callable'",
                              None)),
    ("oracle:nocolon", key("acceptance.factory", "the oracle model needs 'module:callable'",
                           "nocolon")),
    ({"model": "oracle", "factory": 3},
     key("acceptance.factory", "the oracle model needs 'module:callable'", 3)),
    ({"model": "Geometric"}, key("acceptance.model", "must be one of geometric, profile, "
                                 "heterogeneous, all-accept, all-reject, file, oracle",
                                 "Geometric")),
])
def test_each_acceptance_refusal_word_for_word(value, message):
    with pytest.raises(ScenarioError) as err:
        parse_acceptance(value)
    assert str(err.value) == message


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
        ("profile:" + ",".join(["0.5"] * 9), "acceptance.p", ["1..=8"]),
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
def test_the_acceptance_forms_parse_to_their_specs_and_tables():
    assert parse_acceptance("geometric:0.25") == AcceptanceSpec("geometric", (0.25,))
    assert parse_acceptance({"model": "geometric", "p": 0.4}) == AcceptanceSpec("geometric",
                                                                                (0.4,))
    assert parse_acceptance({"p": [1]}) == AcceptanceSpec("geometric", (1.0,))
    assert parse_acceptance({}) == AcceptanceSpec("geometric", (0.7,))
    assert parse_acceptance("profile:1,0") == AcceptanceSpec("profile", (1.0, 0.0))
    assert parse_acceptance("profile:" + ",".join(["0.5"] * 8)).p == (0.5,) * 8
    het = parse_acceptance({"model": "heterogeneous", "p_range": (0.3, 0.3)})
    assert het == AcceptanceSpec("heterogeneous", (), (0.3, 0.3))
    assert acceptance_table(het) == {"model": "heterogeneous", "p_range": [0.3, 0.3]}
    spec = parse_acceptance(AcceptanceSpec("all-accept", ()))
    assert spec == AcceptanceSpec("all-accept", ())
    # p of a model that takes none is ignored (older headers carried the default p)
    assert parse_acceptance({"model": "all-reject", "p": [0.7]}) == AcceptanceSpec(
        "all-reject", ())
    f = parse_acceptance({"model": "file", "path": "a.json", "factory": "m:f"})
    assert f == AcceptanceSpec("file", (), None, "a.json", None)
    assert acceptance_table(f) == {"model": "file", "path": "a.json"}
    o = parse_acceptance({"model": "oracle", "factory": "m:f", "path": "a.json"})
    assert o == AcceptanceSpec("oracle", (), None, None, "m:f")
    assert acceptance_table(o) == {"model": "oracle", "factory": "m:f"}
    assert acceptance_table(parse_acceptance("profile:0.5,0.25")) == {"model": "profile",
                                                                     "p": [0.5, 0.25]}
    assert parse_acceptance("all-accept").model == "all-accept"
    assert parse_acceptance("heterogeneous:0.2,0.9").p == (0.2, 0.9)
    assert parse_acceptance("file:x.json").path == "x.json"
    assert parse_acceptance(
        "oracle:raggedspec.conformance.helpers:make_oracle"
    ).factory.endswith(":make_oracle")


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
