"""A scenario's requests: an explicit list (`requests = [{prompt_len, max_new_tokens,
arrival, may_draft}, ...]`) or a generator (`batch`, `prompt_len`, `max_new_tokens`,
`arrival`, `stagger`), seeded and integer, so the same scenario always yields the same
requests.

Every refusal is a `ScenarioError` naming the key (`requests[2].prompt_len`, `batch`, ...),
what is allowed and the value given (`reference.scenario_values`). `reference.scenario`
re-exports the public names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raggedspec.reference.scenario_values import boolean, choice, fail, int_range, integer

ARRIVALS = ("all-at-once", "staggered")
GENERATOR_KEYS = ("batch", "prompt_len", "max_new_tokens", "arrival", "stagger")
REQUEST_KEYS = ("prompt_len", "max_new_tokens", "arrival", "may_draft")


@dataclass(frozen=True)
class Request:
    """One request: `prompt_len >= 1` prompt tokens, at most `max_new_tokens >= 1` generated
    tokens, arriving at engine step `arrival >= 0`; `may_draft` (default true) is
    `seq_may_draft` of its sampler (false = a sampled, non-greedy request, §9.2)."""

    prompt_len: int
    max_new_tokens: int
    arrival: int = 0
    may_draft: bool = True


def splitmix(x: int) -> int:
    """The splitmix64 output function of `x` (64-bit wrapping arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def draw(seed: int, i: int, salt: int, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from (seed, i, salt): seeded, platform independent. With `sm`
    the splitmix64 output function (64-bit wrapping), `lo + sm(sm(sm(seed ^ salt) ^ i)) %
    (hi - lo + 1)`."""
    if lo == hi:
        return lo
    return lo + splitmix(splitmix(splitmix(seed ^ salt) ^ i)) % (hi - lo + 1)


def generate_requests(gen: dict, seed: int) -> tuple[Request, ...]:
    """The generator's requests: request i has prompt length and max_new_tokens drawn
    uniformly from their inclusive ranges (seeded by (seed, i): `draw` with salt 0x5052
    and 0x4D4E); arrival 0 for all-at-once, `i * stagger` for staggered."""
    b = gen["batch"]
    plo, phi = gen["prompt_len"]
    mlo, mhi = gen["max_new_tokens"]
    out = []
    for i in range(b):
        arrival = 0 if gen["arrival"] == "all-at-once" else i * gen["stagger"]
        out.append(
            Request(draw(seed, i, 0x5052, plo, phi), draw(seed, i, 0x4D4E, mlo, mhi), arrival)
        )
    return tuple(out)


def scenario_requests(data: dict, max_seq_len: int,
                      seed: int) -> tuple[tuple[Request, ...], dict | None]:
    """`(requests, generator)` of a scenario's keys `data`: its explicit `requests` list
    (generator None), else the generator's requests and its resolved table (ranges as lists).
    Refuses a generator key beside an explicit list."""
    if data.get("requests") is None:
        gen = generator_table(data, max_seq_len)
        generator = {k: (list(v) if isinstance(v, tuple) else v) for k, v in gen.items()}
        return generate_requests(gen, seed), generator
    clash = [k for k in GENERATOR_KEYS if k in data]
    if clash:
        fail(clash[0], "cannot be combined with an explicit requests list", data[clash[0]])
    return explicit_requests(data["requests"], max_seq_len), None


def explicit_requests(reqs: Any, max_seq_len: int) -> tuple[Request, ...]:
    """An explicit request list: each a table of `prompt_len` in `1..=max_seq_len - 1`,
    `max_new_tokens >= 1` (default 256), `arrival >= 0` (default 0) and `may_draft` (default
    true). Refuses an empty list or not a list, a request that is not a table, an unknown
    key (naming `requests[i].key`) and any value out of its range."""
    if not isinstance(reqs, list) or not reqs:
        fail("requests", "must be a non-empty list of {prompt_len, max_new_tokens, arrival}",
             reqs)
    parsed = []
    for i, r in enumerate(reqs):
        if not isinstance(r, dict):
            fail(f"requests[{i}]", "must be a table {prompt_len, max_new_tokens, arrival, "
                 "may_draft}", r)
        extra = set(r) - set(REQUEST_KEYS)
        if extra:
            fail(f"requests[{i}].{sorted(extra)[0]}",
                 "unknown key; allowed: prompt_len, max_new_tokens, arrival, may_draft",
                 r[sorted(extra)[0]])
        parsed.append(Request(
            integer(f"requests[{i}].prompt_len", r.get("prompt_len"), 1, max_seq_len - 1),
            integer(f"requests[{i}].max_new_tokens", r.get("max_new_tokens", 256), 1),
            integer(f"requests[{i}].arrival", r.get("arrival", 0), 0),
            boolean(f"requests[{i}].may_draft", r.get("may_draft", True))))
    return tuple(parsed)


def generator_table(data: dict, max_seq_len: int) -> dict:
    """The generator's keys with their defaults: `batch` in `1..=2**20` (8), `prompt_len` and
    `max_new_tokens` an int or an inclusive range (16, 256), `arrival` all-at-once or
    staggered, `stagger >= 1` (1). Refuses any out of range and a prompt length past
    `max_seq_len - 1`."""
    gen = {
        "batch": integer("batch", data.get("batch", 8), 1, 1 << 20),
        "prompt_len": int_range("prompt_len", data.get("prompt_len", 16), 1),
        "max_new_tokens": int_range("max_new_tokens", data.get("max_new_tokens", 256), 1),
        "arrival": choice("arrival", data.get("arrival", "all-at-once"), ARRIVALS),
        "stagger": integer("stagger", data.get("stagger", 1), 1),
    }
    if gen["prompt_len"][1] > max_seq_len - 1:
        fail("prompt_len", f"must be at most max_seq_len - 1 = {max_seq_len - 1}",
             data.get("prompt_len", 16))
    return gen
