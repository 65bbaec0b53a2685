"""Simulator scenarios: what runs, how drafts are accepted, and which engine policy applies.

A scenario is a TOML or JSON file, a dict, or either plus CLI-style overrides. Every key, its
default and its range is in `FIELDS` below (and docs/simulator.md). Requests are either an
explicit list (`requests = [{prompt_len, max_new_tokens, arrival, may_draft}, ...]`) or a
generator (`batch`, `prompt_len`, `max_new_tokens`, `arrival`, `stagger`); the generator is
seeded and integer, so the same scenario always yields the same requests. The advance request,
its flags and refusal chain, and what is refused as malformed are in docs/simulator.md ("Inside
the two modes"); a malformed scenario raises `ScenarioError` (`reference.errors`) naming the
key and the allowed values.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from raggedspec.reference.acceptance import load_accept_file, resolve_factory
from raggedspec.reference.errors import ScenarioError

MAX_DEPTH = 8
ADVANCES = ("cohort", "per-sequence")
WORLDS = ("W0", "WA", "WB")
ADMISSIONS = ("refuse", "grant")
STRIPS = ("eager", "lazy", "none")
ARRIVALS = ("all-at-once", "staggered")
ACCEPTANCE_MODELS = (
    "geometric",
    "profile",
    "heterogeneous",
    "all-accept",
    "all-reject",
    "file",
    "oracle",
)
MODEL_KEYS = (
    "vocab",
    "hidden",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "rope_dims",
    "compress_ratios",
    "sliding_window",
    "seed",
    "mtp",
)

MAX_LENGTH = 2**31 - 1  # lengths fit the trace's 32-bit row columns (reference.policy.ROW_DTYPE)
MAX_SEED = 2**64 - 1  # seeds feed 64-bit splitmix64: a larger one is refused, not reduced
MODEL_INTS = ("vocab", "hidden", "n_heads", "n_kv_heads", "head_dim", "rope_dims",
              "sliding_window")


def _fail(key: str, allowed: str, got: Any) -> None:
    raise ScenarioError(f"scenario key '{key}': {allowed}, got {got!r}")


def _int(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    """`value` as an int in `lo..=hi` (no upper bound when `hi` is None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(key, f"must be an integer{_range(lo, hi)}", value)
    if value < lo or (hi is not None and value > hi):
        _fail(key, f"must be an integer{_range(lo, hi)}", value)
    return int(value)


def _range(lo: int, hi: int | None) -> str:
    return f" >= {lo}" if hi is None else f" in {lo}..={hi}"


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        _fail(key, f"must be one of {', '.join(allowed)}", value)
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(key, "must be true or false", value)
    return value


def _int_range(key: str, value: Any, lo: int) -> tuple[int, int]:
    """An int or an inclusive [lo, hi] pair, each >= lo."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            _fail(key, f"must be an integer >= {lo} or an inclusive [low, high] pair", value)
        a, b = _int(key, value[0], lo), _int(key, value[1], lo)
        if a > b:
            _fail(key, "range [low, high] must have low <= high", value)
        return a, b
    v = _int(key, value, lo)
    return v, v


def _prob(key: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.0 <= float(value) <= 1.0
    ):
        _fail(key, "must be a probability in [0, 1]", value)
    return float(value)


# ----------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class Request:
    """One request: `prompt_len >= 1` prompt tokens, at most `max_new_tokens >= 1` generated
    tokens, arriving at engine step `arrival >= 0`; `may_draft` (default true) is
    `seq_may_draft` of its sampler (false = a sampled, non-greedy request, §9.2)."""

    prompt_len: int
    max_new_tokens: int
    arrival: int = 0
    may_draft: bool = True


@dataclass(frozen=True)
class AcceptanceSpec:
    """Which acceptance model decides the accept counts (reference/acceptance.py).
    `p`: geometric -> one probability; profile -> per draft position; heterogeneous -> per
    sequence (cycled by id); `p_range`: heterogeneous alternative (per-sequence probability
    drawn in [lo, hi]); `path`: the file model's JSON; `factory`: "module:callable" returning a
    `TokenOracle` (the oracle model)."""

    model: str = "geometric"
    p: tuple[float, ...] = (0.7,)
    p_range: tuple[float, float] | None = None
    path: str | None = None
    factory: str | None = None


@dataclass(frozen=True)
class Scenario:
    """A resolved scenario (see the module docstring and `FIELDS`)."""

    requests: tuple[Request, ...]
    depth: int = 3
    max_seq_len: int = 4096
    advance: str = "cohort"
    world: str = "W0"
    admission: str = "refuse"
    strip: str = "eager"
    per_seq_kv: bool = False
    xs_per_seq: bool = False
    max_seqs: int | None = None
    max_draft_kv_seqs: int | None = 64
    prefill_floor: int | None = 4
    prefill_max_seqs: int | None = None
    acceptance: AcceptanceSpec = field(default_factory=AcceptanceSpec)
    model: dict = field(default_factory=dict)
    seed: int = 0
    steps: int = 200
    generator: dict | None = None

    @property
    def batch(self) -> int:
        return len(self.requests)

    def to_dict(self) -> dict:
        """The full resolved scenario as plain JSON data; `load_scenario(to_dict())` gives an
        equal scenario. A generated request list is written as its generator."""
        out: dict[str, Any] = {}
        if self.generator is not None:
            out.update(self.generator)
        else:
            out["requests"] = [asdict(r) for r in self.requests]
        for f in fields(self):
            if f.name in ("requests", "generator"):
                continue
            v = getattr(self, f.name)
            if f.name == "acceptance":
                v = acceptance_table(v)
            elif f.name == "model":
                v = {k: (list(x) if isinstance(x, tuple) else x) for k, x in v.items()}
            out[f.name] = v
        return out


# The documented keys: key -> (default, allowed) for the docs; validation is in load_scenario.
FIELDS: dict[str, tuple[Any, str]] = {
    "requests": (
        None,
        "explicit list of {prompt_len >= 1, max_new_tokens >= 1, arrival >= 0, may_draft}",
    ),
    "batch": (8, "generator: number of requests, >= 1"),
    "prompt_len": (16, "generator: int >= 1 or inclusive [low, high]"),
    "max_new_tokens": (256, "generator: int >= 1 or inclusive [low, high]"),
    "arrival": ("all-at-once", "generator: all-at-once | staggered"),
    "stagger": (1, "generator: steps between staggered arrivals, >= 1"),
    "depth": (3, "MTP depth 0..=8 (w = depth + 1; 0 = plain decode, no MTP wrapper)"),
    "max_seq_len": (4096, "model max_seq_len, 2..2147483647 (the 32-bit trace rows)"),
    "advance": ("cohort", "cohort | per-sequence (per-sequence requests it: ARC_MTP_PER_SEQ_KV)"),
    "world": ("W0", "scheduler world W0 | WA | WB"),
    "admission": ("refuse", "refuse | grant (capability check 4; WB ragged admission)"),
    "strip": (
        "eager",
        "eager | lazy | none (none: record the padded length; the negative control)",
    ),
    "per_seq_kv": (
        "= advance == per-sequence",
        "bool, ARC_MTP_PER_SEQ_KV; must agree with advance",
    ),
    "xs_per_seq": (False, "bool, ARC_V4_XS_PER_SEQ"),
    "max_seqs": (None, "scheduler max running sequences, >= 1 or null (unbounded)"),
    "max_draft_kv_seqs": (64, "draft-KV map LRU capacity (arc: 64), >= 1 or null (unbounded)"),
    "prefill_floor": (4, "WA ARC_PREFILL_FLOOR_STEPS, >= 1, or 0/null = off"),
    "prefill_max_seqs": (None, "WA ARC_PREFILL_MAX_SEQS, >= 1 or null"),
    "acceptance": ("geometric:0.7", "string shorthand or table {model, p, p_range, path, factory}"),
    "model": ({}, "tiny model sizes: " + ", ".join(MODEL_KEYS)),
    "seed": (
        0,
        "int in 0..=2**64-1: acceptance randomness, generated lengths, model weights (unless "
        "model.seed)",
    ),
    "steps": (
        200,
        "engine steps to simulate at most, >= 1 (stops early when every request finished)",
    ),
}

_GENERATOR_KEYS = ("batch", "prompt_len", "max_new_tokens", "arrival", "stagger")
_MAX_STEPS = 10_000_000


# ----------------------------------------------------------------------------- parsing


PROB_MODELS = ("geometric", "profile", "heterogeneous")


def parse_acceptance(value: Any) -> AcceptanceSpec:
    """A string shorthand (`geometric:0.7`, `profile:0.74,0.54,0.41`, `heterogeneous:0.2,0.9`,
    `all-accept`, `all-reject`, `file:PATH`, `oracle:module:callable`) or a table.

    Probabilities are never made up: `profile` needs 1..=8 of them, `heterogeneous` at least
    two (one per class of sequences, cycled by id; for one probability use `geometric`) or a
    `p_range` (not both); `geometric` takes exactly one, and a bare `geometric` (no colon, no
    `p`) is the documented default 0.7. An empty list after the colon (`profile:`) and an
    argument to a model that takes none (`all-accept:0.5`) are refused. This only parses:
    `load_scenario` then checks the file and the factory (`check_acceptance`)."""
    key = "acceptance"
    if isinstance(value, AcceptanceSpec):
        return value
    if isinstance(value, str):
        name, colon, arg = value.partition(":")
        table: dict[str, Any] = {"model": name}
        if name in PROB_MODELS:
            if colon and not arg.strip():
                _fail(key, f"'{name}:' needs its probabilities after the colon, e.g. "
                      f"{_EXAMPLE[name]}", value)
            if arg:
                try:
                    table["p"] = [float(x) for x in arg.split(",")]
                except ValueError:
                    _fail(
                        key,
                        f"probabilities must be comma-separated numbers, e.g. {_EXAMPLE[name]}",
                        value,
                    )
        elif name == "file":
            table["path"] = arg
        elif name == "oracle":
            table["factory"] = arg
        elif colon and name in ACCEPTANCE_MODELS:
            _fail(key, f"'{name}' takes no argument", value)
        value = table
    if not isinstance(value, dict):
        _fail(key, "must be a string like geometric:0.7 or a table {model, p, ...}", value)
    unknown = set(value) - {"model", "p", "p_range", "path", "factory"}
    if unknown:
        _fail(
            f"acceptance.{sorted(unknown)[0]}",
            "unknown key; allowed: model, p, p_range, path, factory",
            value[sorted(unknown)[0]],
        )
    model = _choice("acceptance.model", value.get("model", "geometric"), ACCEPTANCE_MODELS)
    p = value.get("p")
    if p is not None and not isinstance(p, (list, tuple)):
        p = [p]
    p = list(p) if p else []
    p_range = value.get("p_range")
    if model not in PROB_MODELS:
        # p is not used by this model; a table's p is ignored rather than refused, because
        # headers written before this rule carried the default p = [0.7] for every model
        probs: tuple[float, ...] = ()
    elif model == "geometric":
        probs = tuple(_prob("acceptance.p", x) for x in (p or [0.7]))
        if len(probs) != 1:
            _fail("acceptance.p", "geometric takes exactly one probability, e.g. geometric:0.7", p)
    elif model == "profile":
        probs = tuple(_prob("acceptance.p", x) for x in p)
        if not 1 <= len(probs) <= 8:
            _fail(
                "acceptance.p",
                "profile needs 1..=8 per-position probabilities (one per draft position, the "
                "last repeats), e.g. profile:0.74,0.54,0.41",
                p,
            )
    else:
        probs = tuple(_prob("acceptance.p", x) for x in p)
        if p_range is None and len(probs) < 2:
            _fail(
                "acceptance.p",
                "heterogeneous needs at least two probabilities (sequence i gets p[i mod n]; "
                "for one probability for every sequence use geometric:p), e.g. "
                "heterogeneous:0.2,0.9, or "
                "a p_range = [low, high]",
                p,
            )
        if p_range is not None and probs:
            _fail("acceptance.p", "heterogeneous takes either p (a list) or p_range, not both", p)
    if p_range is not None:
        if model != "heterogeneous" or not isinstance(p_range, (list, tuple)) or len(p_range) != 2:
            _fail(
                "acceptance.p_range",
                "only for heterogeneous: a [low, high] pair of probabilities",
                p_range,
            )
        p_range = (_prob("acceptance.p_range", p_range[0]), _prob("acceptance.p_range", p_range[1]))
        if p_range[0] > p_range[1]:
            _fail("acceptance.p_range", "must have low <= high", list(p_range))
    path = value.get("path")
    if model == "file" and not (isinstance(path, str) and path):
        _fail("acceptance.path", "the file model needs a JSON path", path)
    factory = value.get("factory")
    if model == "oracle" and not (isinstance(factory, str) and ":" in factory):
        _fail("acceptance.factory", "the oracle model needs 'module:callable'", factory)
    return AcceptanceSpec(model, probs, p_range, path if model == "file" else None,
                          factory if model == "oracle" else None)


_EXAMPLE = {"geometric": "geometric:0.7", "profile": "profile:0.74,0.54,0.41",
            "heterogeneous": "heterogeneous:0.2,0.9"}


def acceptance_table(spec: AcceptanceSpec) -> dict:
    """The table form of an AcceptanceSpec (only the keys its model uses; lists, not
    tuples): `parse_acceptance(acceptance_table(spec)) == spec`."""
    out: dict[str, Any] = {"model": spec.model}
    if spec.p:
        out["p"] = list(spec.p)
    if spec.p_range is not None:
        out["p_range"] = list(spec.p_range)
    if spec.path is not None:
        out["path"] = spec.path
    if spec.factory is not None:
        out["factory"] = spec.factory
    return out


def check_acceptance(spec: AcceptanceSpec, n_seqs: int) -> None:
    """What can only be checked outside the parser: the file model's file exists and holds
    valid accept counts (covering every one of the `n_seqs` sequences when it has no
    default), and the oracle's factory imports and is callable. Raises ScenarioError naming
    `acceptance.path` / `acceptance.factory` and the bad value (reference.acceptance)."""
    if spec.model == "file":
        load_accept_file(spec.path, n_seqs)
    elif spec.model == "oracle":
        resolve_factory(spec.factory)


def _parse_override_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _apply_overrides(data: dict, overrides) -> dict:
    """Overrides: a dict {key: value} or a list of "key=value" strings (values parsed as
    JSON, else kept as strings). Dotted keys reach into tables (`model.vocab=32`,
    `acceptance.p=[0.5]`). A generator key overrides an explicit request list only when the
    list is removed, so giving `batch` with a `requests` list is an error."""
    if not overrides:
        return data
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for o in overrides:
            if not isinstance(o, str) or "=" not in o:
                _fail("overrides", "each override must be 'key=value'", o)
            k, _, v = o.partition("=")
            items.append((k.strip(), _parse_override_value(v.strip())))
    out = dict(data)
    for k, v in items:
        if v is None:
            continue
        parts = k.split(".")
        if len(parts) == 1:
            out[k] = v
            continue
        table = out.get(parts[0])
        if isinstance(table, str) and parts[0] == "acceptance":
            table = acceptance_table(parse_acceptance(table))
        table = dict(table or {})
        if len(parts) != 2:
            _fail(k, "overrides reach at most one table level (table.key)", v)
        table[parts[1]] = v
        out[parts[0]] = table
    return out


def _read(source) -> dict:
    if isinstance(source, Scenario):
        return source.to_dict()
    if isinstance(source, dict):
        return dict(source)
    if source is None:
        return {}
    path = Path(source)
    if not path.is_file():
        raise ScenarioError(f"scenario file {path} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"scenario file {path} is not UTF-8 text (byte {exc.start}: "
                            f"{exc.reason}); save it as UTF-8 TOML or JSON") from None
    except OSError as exc:
        raise ScenarioError(f"scenario file {path} cannot be read: {exc.strerror}") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(
            f"scenario file {path} is not valid {path.suffix[1:].upper()}: {exc}"
        ) from exc


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _draw(seed: int, i: int, salt: int, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from (seed, i, salt): seeded, platform independent. With `sm`
    the splitmix64 output function (64-bit wrapping), `lo + sm(sm(sm(seed ^ salt) ^ i)) %
    (hi - lo + 1)`."""
    if lo == hi:
        return lo
    return lo + _splitmix(_splitmix(_splitmix(seed ^ salt) ^ i)) % (hi - lo + 1)


def generate_requests(gen: dict, seed: int) -> tuple[Request, ...]:
    """The generator's requests: request i has prompt length and max_new_tokens drawn
    uniformly from their inclusive ranges (seeded by (seed, i): `_draw` with salt 0x5052
    and 0x4D4E); arrival 0 for all-at-once, `i * stagger` for staggered."""
    b = gen["batch"]
    plo, phi = gen["prompt_len"]
    mlo, mhi = gen["max_new_tokens"]
    out = []
    for i in range(b):
        arrival = 0 if gen["arrival"] == "all-at-once" else i * gen["stagger"]
        out.append(
            Request(_draw(seed, i, 0x5052, plo, phi), _draw(seed, i, 0x4D4E, mlo, mhi), arrival)
        )
    return tuple(out)


def _opt_int(key: str, value: Any, lo: int) -> int | None:
    return None if value is None else _int(key, value, lo)


def load_scenario(source=None, overrides=None) -> Scenario:
    """Load a scenario from a TOML/JSON path, a dict, a `Scenario` or None (all defaults),
    apply `overrides`, fill defaults and validate. Raises ScenarioError naming the key and its
    allowed range on any malformed value, unknown key or contradiction."""
    data = _apply_overrides(_read(source), overrides)
    if not isinstance(data, dict):
        raise ScenarioError(f"a scenario must be a table of keys, got {type(data).__name__}")
    known = set(FIELDS)
    for k in data:
        if k not in known:
            _fail(k, "unknown key; allowed keys: " + ", ".join(FIELDS), data[k])
    seed = _int("seed", data.get("seed", 0), 0, MAX_SEED)
    max_seq_len = _int("max_seq_len", data.get("max_seq_len", 4096), 2, MAX_LENGTH)
    generator = None
    if "requests" in data and data["requests"] is not None:
        clash = [k for k in _GENERATOR_KEYS if k in data]
        if clash:
            _fail(clash[0], "cannot be combined with an explicit requests list", data[clash[0]])
        reqs = data["requests"]
        if not isinstance(reqs, list) or not reqs:
            _fail(
                "requests",
                "must be a non-empty list of {prompt_len, max_new_tokens, arrival}",
                reqs,
            )
        parsed = []
        for i, r in enumerate(reqs):
            if not isinstance(r, dict):
                _fail(
                    f"requests[{i}]",
                    "must be a table {prompt_len, max_new_tokens, arrival, may_draft}",
                    r,
                )
            extra = set(r) - {"prompt_len", "max_new_tokens", "arrival", "may_draft"}
            if extra:
                _fail(
                    f"requests[{i}].{sorted(extra)[0]}",
                    "unknown key; allowed: prompt_len, max_new_tokens, arrival, may_draft",
                    r[sorted(extra)[0]],
                )
            parsed.append(Request(
                _int(f"requests[{i}].prompt_len", r.get("prompt_len"), 1, max_seq_len - 1),
                _int(f"requests[{i}].max_new_tokens", r.get("max_new_tokens", 256), 1),
                _int(f"requests[{i}].arrival", r.get("arrival", 0), 0),
                _bool(f"requests[{i}].may_draft", r.get("may_draft", True))))
        requests = tuple(parsed)
    else:
        gen = {
            "batch": _int("batch", data.get("batch", 8), 1, 1 << 20),
            "prompt_len": _int_range("prompt_len", data.get("prompt_len", 16), 1),
            "max_new_tokens": _int_range("max_new_tokens", data.get("max_new_tokens", 256), 1),
            "arrival": _choice("arrival", data.get("arrival", "all-at-once"), ARRIVALS),
            "stagger": _int("stagger", data.get("stagger", 1), 1),
        }
        if gen["prompt_len"][1] > max_seq_len - 1:
            _fail(
                "prompt_len",
                f"must be at most max_seq_len - 1 = {max_seq_len - 1}",
                data.get("prompt_len", 16),
            )
        requests = generate_requests(gen, seed)
        generator = {k: (list(v) if isinstance(v, tuple) else v) for k, v in gen.items()}
    depth = _int("depth", data.get("depth", 3), 0, MAX_DEPTH)
    advance = _choice("advance", data.get("advance", "cohort"), ADVANCES)
    per_seq_kv = data.get("per_seq_kv", advance == "per-sequence")
    per_seq_kv = _bool("per_seq_kv", per_seq_kv)
    if per_seq_kv != (advance == "per-sequence"):
        _fail(
            "per_seq_kv",
            f"is the ARC_MTP_PER_SEQ_KV request and must equal (advance == 'per-sequence') "
            f"= {advance == 'per-sequence'}",
            per_seq_kv,
        )
    model = data.get("model") or {}
    if not isinstance(model, dict):
        _fail("model", "must be a table of " + ", ".join(MODEL_KEYS), model)
    model = _model_table(model)
    floor = data.get("prefill_floor", 4)
    floor = None if floor in (None, 0) else _int("prefill_floor", floor, 0)
    steps = _int("steps", data.get("steps", 200), 1, _MAX_STEPS)
    sc = Scenario(
        requests=requests,
        depth=depth,
        max_seq_len=max_seq_len,
        advance=advance,
        world=_choice("world", data.get("world", "W0"), WORLDS),
        admission=_choice("admission", data.get("admission", "refuse"), ADMISSIONS),
        strip=_choice("strip", data.get("strip", "eager"), STRIPS),
        per_seq_kv=per_seq_kv,
        xs_per_seq=_bool("xs_per_seq", data.get("xs_per_seq", False)),
        max_seqs=_opt_int("max_seqs", data.get("max_seqs"), 1),
        max_draft_kv_seqs=_opt_int("max_draft_kv_seqs", data.get("max_draft_kv_seqs", 64), 1),
        prefill_floor=floor,
        prefill_max_seqs=_opt_int("prefill_max_seqs", data.get("prefill_max_seqs"), 1),
        acceptance=parse_acceptance(data.get("acceptance", "geometric:0.7")),
        model=model,
        seed=seed,
        steps=steps,
        generator=generator,
    )
    model_config(sc)  # validates the model table
    check_acceptance(sc.acceptance, sc.batch)  # the file exists and parses, the factory resolves
    return sc


def _model_table(model: dict) -> dict:
    """The `model` table with every key known and of its type (sizes integers >= 1, `seed`
    in 0..=2**64-1, `compress_ratios` a list of integers >= 0, `mtp` block or heads); a
    ScenarioError names the key, the value and what is allowed."""
    for k, v in model.items():
        if k not in MODEL_KEYS:
            _fail(f"model.{k}", "unknown key; allowed: " + ", ".join(MODEL_KEYS), v)
        if k in MODEL_INTS:
            _int(f"model.{k}", v, 1)
        elif k == "seed":
            _int("model.seed", v, 0, MAX_SEED)
        elif k == "mtp":
            _choice("model.mtp", v, ("block", "heads"))
        elif k == "compress_ratios":
            if not isinstance(v, (list, tuple)):
                _fail("model.compress_ratios", "must be a list of integers >= 0", v)
            for r in v:
                _int("model.compress_ratios", r, 0)
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in model.items()}


def model_config(sc: Scenario):
    """The `reference.model.ModelConfig` of a scenario: its `model` table, `max_seq_len`,
    and `seed` unless `model.seed` is given. A bad size raises ScenarioError naming it."""
    from raggedspec.reference.model import ModelConfig

    kw = dict(sc.model)
    kw.setdefault("seed", sc.seed)
    kw["max_seq_len"] = sc.max_seq_len
    if "compress_ratios" in kw:
        kw["compress_ratios"] = tuple(kw["compress_ratios"])
    try:
        cfg = ModelConfig(**kw)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"scenario key 'model': {exc}") from exc
    if cfg.vocab < 2:
        raise ScenarioError(f"scenario key 'model.vocab': must be >= 2, got {cfg.vocab}")
    return cfg
