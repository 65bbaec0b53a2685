"""Simulator scenarios: what runs, how drafts are accepted, and which engine policy applies.

A scenario is a TOML or JSON file, a dict, or either plus CLI-style overrides. Every key, its
default and its range is in `FIELDS` below (and docs/simulator.md). Requests are either an
explicit list (`requests = [{prompt_len, max_new_tokens, arrival, may_draft}, ...]`) or a
generator (`batch`, `prompt_len`, `max_new_tokens`, `arrival`, `stagger`); the generator is
seeded and integer, so the same scenario always yields the same requests. The advance request,
its flags and refusal chain, and what is refused as malformed are in docs/simulator.md ("Inside
the two modes"); a malformed scenario raises `ScenarioError` (`reference.errors`) naming the
key and the allowed values.

The `acceptance` key is parsed in `reference.scenario_acceptance`, the requests in
`reference.scenario_requests`, each value checked by `reference.scenario_values`; their public
names (`AcceptanceSpec`, `parse_acceptance`, `Request`, `generate_requests`, ...) are
importable from here too.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from raggedspec.reference.errors import ScenarioError
from raggedspec.reference.scenario_acceptance import (  # the acceptance names, re-exported
    ACCEPTANCE_MODELS as ACCEPTANCE_MODELS,
    PROB_MODELS as PROB_MODELS,
    AcceptanceSpec,
    acceptance_table,
    check_acceptance,
    parse_acceptance,
)
from raggedspec.reference.scenario_requests import (  # the request names, re-exported
    ARRIVALS as ARRIVALS,
    Request,
    generate_requests as generate_requests,
    scenario_requests,
)
from raggedspec.reference.scenario_values import (
    boolean,
    choice,
    fail,
    integer,
    optional_int,
)

MAX_DEPTH = 8
ADVANCES = ("cohort", "per-sequence")
WORLDS = ("W0", "WA", "WB")
ADMISSIONS = ("refuse", "grant")
STRIPS = ("eager", "lazy", "none")
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


# ----------------------------------------------------------------------------- dataclasses


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

MAX_STEPS = 10_000_000


# ----------------------------------------------------------------------------- parsing


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
                fail("overrides", "each override must be 'key=value'", o)
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
            fail(k, "overrides reach at most one table level (table.key)", v)
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
            fail(k, "unknown key; allowed keys: " + ", ".join(FIELDS), data[k])
    seed = integer("seed", data.get("seed", 0), 0, MAX_SEED)
    max_seq_len = integer("max_seq_len", data.get("max_seq_len", 4096), 2, MAX_LENGTH)
    requests, generator = scenario_requests(data, max_seq_len, seed)
    depth = integer("depth", data.get("depth", 3), 0, MAX_DEPTH)
    advance = choice("advance", data.get("advance", "cohort"), ADVANCES)
    per_seq_kv = per_seq_kv_flag(data, advance)
    model = data.get("model") or {}
    if not isinstance(model, dict):
        fail("model", "must be a table of " + ", ".join(MODEL_KEYS), model)
    model = _model_table(model)
    floor = data.get("prefill_floor", 4)
    floor = None if floor in (None, 0) else integer("prefill_floor", floor, 0)
    steps = integer("steps", data.get("steps", 200), 1, MAX_STEPS)
    sc = Scenario(
        requests=requests,
        depth=depth,
        max_seq_len=max_seq_len,
        advance=advance,
        world=choice("world", data.get("world", "W0"), WORLDS),
        admission=choice("admission", data.get("admission", "refuse"), ADMISSIONS),
        strip=choice("strip", data.get("strip", "eager"), STRIPS),
        per_seq_kv=per_seq_kv,
        xs_per_seq=boolean("xs_per_seq", data.get("xs_per_seq", False)),
        max_seqs=optional_int("max_seqs", data.get("max_seqs"), 1),
        max_draft_kv_seqs=optional_int("max_draft_kv_seqs", data.get("max_draft_kv_seqs", 64), 1),
        prefill_floor=floor,
        prefill_max_seqs=optional_int("prefill_max_seqs", data.get("prefill_max_seqs"), 1),
        acceptance=parse_acceptance(data.get("acceptance", "geometric:0.7")),
        model=model,
        seed=seed,
        steps=steps,
        generator=generator,
    )
    model_config(sc)  # validates the model table
    check_acceptance(sc.acceptance, sc.batch)  # the file exists and parses, the factory resolves
    return sc


def per_seq_kv_flag(data: dict, advance: str) -> bool:
    """The `per_seq_kv` key (default: `advance == "per-sequence"`): the ARC_MTP_PER_SEQ_KV
    request, a bool. Refuses anything else, and a flag that disagrees with `advance`."""
    per_seq_kv = boolean("per_seq_kv", data.get("per_seq_kv", advance == "per-sequence"))
    if per_seq_kv != (advance == "per-sequence"):
        fail(
            "per_seq_kv",
            f"is the ARC_MTP_PER_SEQ_KV request and must equal (advance == 'per-sequence') "
            f"= {advance == 'per-sequence'}",
            per_seq_kv,
        )
    return per_seq_kv


def _model_table(model: dict) -> dict:
    """The `model` table with every key known and of its type (sizes integers >= 1, `seed`
    in 0..=2**64-1, `compress_ratios` a list of integers >= 0, `mtp` block or heads); a
    ScenarioError names the key, the value and what is allowed."""
    for k, v in model.items():
        if k not in MODEL_KEYS:
            fail(f"model.{k}", "unknown key; allowed: " + ", ".join(MODEL_KEYS), v)
        if k in MODEL_INTS:
            integer(f"model.{k}", v, 1)
        elif k == "seed":
            integer("model.seed", v, 0, MAX_SEED)
        elif k == "mtp":
            choice("model.mtp", v, ("block", "heads"))
        elif k == "compress_ratios":
            if not isinstance(v, (list, tuple)):
                fail("model.compress_ratios", "must be a list of integers >= 0", v)
            for r in v:
                integer("model.compress_ratios", r, 0)
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
