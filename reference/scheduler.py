"""Scheduling, ragged admission and the engine's cache instruction.

Spec: masks-and-scheduling.md §0 (the three worlds), §15-§18, §20, §21. Everything here is
integer bookkeeping over small sequence records; no tensors. The three worlds' keys, how ties
are broken and the cross-step state (`SchedulerState`) are in docs/simulator.md ("Inside the
two modes").
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from raggedspec.reference.errors import Refusal, SchedulerRefusal, require
from raggedspec.reference.scheduler_telemetry import BucketTelemetry

WORLDS = ("W0", "WA", "WB")
COALESCE_PAYBACK_STEPS = 256
DEFAULT_PREFILL_FLOOR_STEPS = 4
RAGGED_ADMISSION_ON = "Ragged batch admission is ON"
_USIZE = re.compile(r"\+?[0-9]+")  # what Rust's `str::parse::<usize>` accepts


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class SeqRecord:
    """What the scheduler reads of one sequence.

    `n_tokens` is `len()` (token count, >= 1); `cache_len` is the `current_seq_len` of its
    first populated cache slot, or None before it has a cache; `is_prompt` is True until
    its prefill ran (a new request is a prompt); `images` says it carries images.
    Urgency is not a field: it is `SchedulerState.urgency[id]` (one source of truth)."""

    id: int
    n_tokens: int
    cache_len: int | None = None
    is_prompt: bool = False
    token_offset: int = 0
    images: bool = False

    def __post_init__(self) -> None:
        require(self.id >= 0, f"sequence id {self.id} must be >= 0")
        require(self.n_tokens >= 1, f"sequence {self.id}: n_tokens {self.n_tokens} must be >= 1")
        require(self.cache_len is None or self.cache_len >= 0,
                f"sequence {self.id}: cache_len {self.cache_len} must be None or >= 0")
        require(
            self.token_offset >= 0,
            f"sequence {self.id}: token_offset {self.token_offset} must be >= 0",
        )


def first_populated_slot_len(slot_lens: Sequence[int | None]) -> int | None:
    """The `current_seq_len` of the first populated cache slot (slot 0 on V4), or None when
    no slot is populated. Invariant: never reads past the first populated slot (§15)."""
    for n in slot_lens:
        if n is not None:
            require(n >= 0, f"slot length {n} must be >= 0")
            return int(n)
    return None


def cache_bucket_len(cache_len: int | None, n_tokens: int) -> int:
    """§15: the sequence's own cache length when it has one, else `len() - 1` saturating.
    A fresh 101-token sequence -> 100. Never the token count when a cache exists."""
    require(n_tokens >= 0, f"n_tokens {n_tokens} must be >= 0")
    if cache_len is not None:
        require(cache_len >= 0, f"cache_len {cache_len} must be >= 0")
        return int(cache_len)
    return max(n_tokens - 1, 0)


def compute_priority(urgency: int, n_tokens: int) -> float:
    """§15: `urgency + log2(len())`. Urgency rises by 1 per waitlisted pass and resets to 0
    when the sequence runs (see `bucket_and_waitlist_seqs_waiting`)."""
    require(urgency >= 0, f"urgency {urgency} must be >= 0")
    require(n_tokens >= 1, f"n_tokens {n_tokens} must be >= 1 (log2 of a length)")
    return urgency + math.log2(n_tokens)


# --------------------------------------------------------------------------- admission


@dataclass(frozen=True)
class RaggedAdmission:
    """§17, WB: may one forward carry sequences at different cache lengths?

    `refused()` (the default) has no reason; `decide(None)` grants; `decide(why)` refuses
    and keeps `why` (a string or a `Refusal`, e.g. `capability.per_sequence_refusal(...)`).
    `buckets_by_cache_length() == not granted`, `assembles_every_step() == granted`."""

    granted: bool = False
    refusal: str | None = None

    @staticmethod
    def refused() -> RaggedAdmission:
        return RaggedAdmission(False, None)

    @staticmethod
    def decide(why: str | Refusal | None) -> RaggedAdmission:
        if why is None:
            return RaggedAdmission(True, None)
        return RaggedAdmission(False, str(why))

    def buckets_by_cache_length(self) -> bool:
        return not self.granted

    def assembles_every_step(self) -> bool:
        return self.granted


def issues_cache_in(no_kv: bool, cohort_changed: bool, granted: bool) -> bool:
    """§17: the WB engine's `pre_op == In` predicate, `!no_kv and (changed or granted)`.
    With `granted == False` it is exactly the W0 rule `!no_kv and changed`."""
    return (not no_kv) and (cohort_changed or granted)


# --------------------------------------------------------------------------- WA floor / cap


def prefill_starvation_floor(value: str | None) -> int | None:
    """§16 `ARC_PREFILL_FLOOR_STEPS` by value: unset or unparseable -> 4 (the default, ON);
    "0" -> None (the kill switch); any other unsigned integer n -> n. Parsing follows Rust's
    `usize` parse: optional '+', ASCII digits, no spaces or sign '-'."""
    if value is None or not _USIZE.fullmatch(value):
        return DEFAULT_PREFILL_FLOOR_STEPS
    n = int(value)
    return None if n == 0 else n


def prefill_admission_cap(value: str | None) -> int | None:
    """§16 `ARC_PREFILL_MAX_SEQS`: the most waiting sequences promoted at once, or None (no
    cap) when unset, "0" or unparseable (this variable has no default, unlike the floor)."""
    if value is None or not _USIZE.fullmatch(value):
        return None
    n = int(value)
    return None if n == 0 else n


@dataclass
class PrefillFloor:
    """§16 WA prefill floor: a prompt bucket is forced after `floor` consecutive passes
    without one, so a prompt runs every `floor + 1` multi-bucket steps. `floor=None` is
    disabled. Not applied (counter untouched) when `discrete`."""

    floor: int | None = DEFAULT_PREFILL_FLOOR_STEPS
    steps_since_prompt: int = 0

    def __post_init__(self) -> None:
        require(self.floor is None or self.floor >= 1, f"floor {self.floor} must be None or >= 1")
        require(
            self.steps_since_prompt >= 0,
            f"steps_since_prompt {self.steps_since_prompt} must be >= 0",
        )

    def apply(self, chosen: tuple, prompt_keys: Sequence[tuple], discrete: bool) -> tuple:
        """The bucket that runs after the floor: chosen a prompt bucket -> reset; else
        counter >= floor and a prompt bucket exists -> the smallest prompt key, reset; else
        counter += 1."""
        if self.floor is None or discrete:
            return chosen
        if chosen in prompt_keys:
            self.steps_since_prompt = 0
            return chosen
        if self.steps_since_prompt >= self.floor and prompt_keys:
            self.steps_since_prompt = 0
            return min(prompt_keys)
        self.steps_since_prompt += 1
        return chosen


# --------------------------------------------------------------------------- state


@dataclass
class SchedulerState:
    """Everything the scheduler and the engine carry across steps (see module docstring).

    `admission` is the scheduler's copy of the WB decision, `engine_admission` the engine's
    (and pipeline's); `install_admission` pushes one decision to both, and
    `plan_engine_iteration` refuses to run when they differ. `ragged_decode_supported` is
    the WA channel: the simulator writes `CloneIn.ragged_decode_supported` after each In.
    `floor` and `prefill_cap` act in WA only. `admitted` is the set of ids that have been in
    the running set (a waiting id outside it is a new request, counted by the WA cap)."""

    world: str = "W0"
    max_seqs: int = 1 << 30
    prefill_cap: int | None = None
    floor: PrefillFloor = field(default_factory=PrefillFloor)
    ragged_decode_supported: bool = False
    admission: RaggedAdmission = field(default_factory=RaggedAdmission.refused)
    engine_admission: RaggedAdmission = field(default_factory=RaggedAdmission.refused)
    urgency: dict[int, int] = field(default_factory=dict)
    admitted: set[int] = field(default_factory=set)
    last_completion_ids: list[int] = field(default_factory=list)
    telemetry: BucketTelemetry = field(default_factory=BucketTelemetry)
    last_decode_bucketing: tuple[int, bool] | None = None
    decisions: int = 0
    logged_once: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        require(self.world in WORLDS, f"world {self.world!r} must be one of {WORLDS}")
        require(self.max_seqs >= 1, f"max_seqs {self.max_seqs} must be >= 1")
        require(self.prefill_cap is None or self.prefill_cap >= 1,
                f"prefill_cap {self.prefill_cap} must be None or >= 1")


def install_admission(state: SchedulerState, decision: RaggedAdmission) -> str | None:
    """§17: the decision made once in `Engine::new` is pushed to the scheduler AND to the
    engine/pipeline (a grant must reach both). Returns the info line `Ragged batch admission
    is ON: completions share one bucket and the batch is re-assembled every step` when
    granted, else None."""
    state.admission = decision
    state.engine_admission = decision
    if decision.granted:
        return (
            f"{RAGGED_ADMISSION_ON}: completions share one bucket and the batch is re-assembled "
            "every step"
        )
    return None


def check_admission_agrees(state: SchedulerState) -> None:
    """Refuses ("a grant must reach both") when the scheduler's and the engine's copies of
    the admission decision differ: a grant that reached only the scheduler forms ragged
    cohorts the engine never re-aligns."""
    if state.admission.granted != state.engine_admission.granted:
        raise SchedulerRefusal(
            f"a grant must reach both the scheduler and the engine: scheduler granted="
            f"{state.admission.granted}, engine granted={state.engine_admission.granted}")


# --------------------------------------------------------------------------- keys


def ragged_bucket_len(running: Sequence[SeqRecord], admission: RaggedAdmission) -> int | None:
    """§15 WB: the shared len of every completion when admission is granted: the minimum
    `cache_bucket_len` over completions only (prompts never pull it). None when refused or
    when nothing running is a completion."""
    if admission.buckets_by_cache_length():
        return None
    lens = [cache_bucket_len(s.cache_len, s.n_tokens) for s in running if not s.is_prompt]
    return min(lens) if lens else None


def scheduler_key(world: str, seq: SeqRecord, *, ragged_decode_supported: bool = False,
                  ragged_len: int | None = None) -> tuple:
    """§15 bucket key of one sequence.
    W0: `(cache_bucket_len, images and is_prompt, token_offset)`.
    WA: the same, with len pinned to 0 for a completion when `ragged_decode_supported`.
    WB: a completion with `ragged_len` not None -> `(ragged_len, imgs, offset, True)`;
        anything else -> the W0 key + `(False,)`."""
    require(world in WORLDS, f"world {world!r} must be one of {WORLDS}")
    imgs = seq.images and seq.is_prompt
    length = cache_bucket_len(seq.cache_len, seq.n_tokens)
    if world == "WA" and ragged_decode_supported and not seq.is_prompt:
        length = 0
    if world != "WB":
        return (length, imgs, seq.token_offset)
    if ragged_len is not None and not seq.is_prompt:
        return (ragged_len, imgs, seq.token_offset, True)
    return (length, imgs, seq.token_offset, False)


def bucket_keys(running: Sequence[SeqRecord], state: SchedulerState) -> list[tuple]:
    """The key of every running sequence under `state.world` (one entry per sequence)."""
    ragged_len = ragged_bucket_len(running, state.admission) if state.world == "WB" else None
    return [scheduler_key(state.world, s, ragged_decode_supported=state.ragged_decode_supported,
                          ragged_len=ragged_len) for s in running]


# --------------------------------------------------------------------------- selection


def select_running_bucket(buckets: Mapping[tuple, Sequence], priorities: Mapping[tuple, float],
                          discrete: bool) -> tuple:
    """§16: the one bucket that runs. `buckets` maps key -> members (only sizes are read),
    `priorities` key -> summed `compute_priority` (unused when `discrete`).
    1. `min` = smallest len (ties: smallest key); `discrete` -> min.
    2. `greedy` = largest priority (ties: smallest key); greedy == min -> min.
    3. `next_len` = smallest len above min's among keys equal to min in every other
       component (imgs, offset and, in WB, the ragged flag); none -> greedy.
    4. min iff `(total - n_min) * gap <= n_min * COALESCE_PAYBACK_STEPS`, else greedy."""
    require(len(buckets) > 0, "select_running_bucket needs at least one bucket")
    require(all(len(m) > 0 for m in buckets.values()), "every bucket must have a member")
    lo = min(buckets)
    if discrete:
        return lo
    require(set(priorities) == set(buckets),
            f"priorities keys {sorted(priorities)} must match bucket keys {sorted(buckets)}")
    best = max(priorities.values())
    greedy = min(k for k, p in priorities.items() if p == best)
    if greedy == lo:
        return lo
    above = [k[0] for k in buckets if k[0] > lo[0] and k[1:] == lo[1:]]
    if not above:
        return greedy
    n_min = len(buckets[lo])
    total = sum(len(m) for m in buckets.values())
    gap = min(above) - lo[0]
    return lo if (total - n_min) * gap <= n_min * COALESCE_PAYBACK_STEPS else greedy


@dataclass
class Bucketing:
    """One bucketing decision: the key that ran, its members, the waitlisted rest (in
    running order), the number of buckets formed and the log lines it emitted."""

    key: tuple | None
    chosen: list[SeqRecord]
    waitlisted: list[SeqRecord]
    n_buckets: int
    logs: list[str]


def bucket_and_waitlist_seqs_waiting(running: Sequence[SeqRecord], discrete: bool,
                                     state: SchedulerState) -> Bucketing:
    """§16: bucket the running set by key; with <= 1 bucket everything runs, else the
    selected bucket runs (WA: after the prefill floor) and every other sequence is
    waitlisted, state unchanged. Urgency: chosen -> 0, waitlisted -> +1. A bucket is a
    prompt bucket (for the floor) when its first member is a prompt. Records one
    `record_bucketing(buckets, offered, chosen)` into `state.telemetry` and, in WA, the
    `ArcSched: decode bucketing` line when `(buckets, ragged_decode)` changed."""
    keys = bucket_keys(running, state)
    buckets: dict[tuple, list[SeqRecord]] = {}
    priorities: dict[tuple, float] = {}
    for s, k in zip(running, keys, strict=False):
        buckets.setdefault(k, []).append(s)
        priorities[k] = priorities.get(k, 0.0) + compute_priority(
            state.urgency.get(s.id, 0), s.n_tokens
        )
    logs: list[str] = []
    if state.world == "WA":
        now = (len(buckets), state.ragged_decode_supported)
        if now != state.last_decode_bucketing:
            logs.append(f"ArcSched: decode bucketing ragged_decode={str(now[1]).lower()} "
                        f"buckets={now[0]} seqs={len(running)} decisions={state.decisions}")
            state.last_decode_bucketing = now
        state.decisions += 1
    if len(buckets) <= 1:
        key = next(iter(buckets), None)
    else:
        key = select_running_bucket(buckets, priorities, discrete)
        if state.world == "WA":
            prompt_keys = [k for k, m in buckets.items() if m[0].is_prompt]
            forced = state.floor.apply(key, prompt_keys, discrete)
            if forced != key and "floor" not in state.logged_once:
                state.logged_once.add("floor")
                logs.append(
                    f"ARC prefill floor: forced a prompt bucket after {state.floor.floor} passes "
                    f"(ARC_PREFILL_FLOOR_STEPS={state.floor.floor}); logged once"
                )
            key = forced
    chosen = buckets.get(key, []) if key is not None else []
    waitlisted = [s for s, k in zip(running, keys, strict=False) if k != key]
    for s in chosen:
        state.urgency[s.id] = 0
    for s in waitlisted:
        state.urgency[s.id] = state.urgency.get(s.id, 0) + 1
    state.telemetry.record_bucketing(len(buckets), len(running), len(chosen))
    return Bucketing(key, list(chosen), waitlisted, len(buckets), logs)


# --------------------------------------------------------------------------- one step


@dataclass
class ScheduleOutcome:
    """One `schedule` call. `running`/`waiting` are the new sets to hand back next step;
    `completion`/`prompt` split the running ids by `is_prompt`; `waitlisted` lost the
    bucketing; `held` were not admitted (max_seqs or the WA cap); `promoted` are the new
    requests admitted this step; `offered` is the running-set size before selection."""

    key: tuple | None
    discrete: bool | None
    running: list[SeqRecord]
    waiting: list[SeqRecord]
    completion: list[int]
    prompt: list[int]
    waitlisted: list[int]
    held: list[int]
    promoted: list[int]
    n_buckets: int
    offered: int
    logs: list[str]

    @property
    def chosen(self) -> int:
        return len(self.running)


def schedule(running: Sequence[SeqRecord], waiting: Sequence[SeqRecord],
             state: SchedulerState) -> ScheduleOutcome:
    """§20.1 one scheduler step (all worlds; the world only changes the keys, the WA floor
    and the WA cap).
    - nothing waiting or running -> nothing;
    - waiting only -> promote the waiting queue in order (WA: the first `prefill_cap`, the
      rest held), bucket with `discrete=True`;
    - running only -> bucket with `discrete=True` (the shortest bucket runs);
    - both -> sort waiting by id; admit while `len(running) + 1 <= max_seqs` (WA: at most
      `prefill_cap` new requests), bucket with `discrete=False`.
    New waiting = held (in order) + waitlisted (in running order). Unspecified, chosen: a
    waitlisted completion promoted back keeps `is_prompt=False` (§16: its state is
    unchanged); the caller drops finished sequences before calling (no reaping)."""
    ids = [s.id for s in running] + [s.id for s in waiting]
    require(
        len(ids) == len(set(ids)), f"sequence ids {ids} must be unique across running and waiting"
    )
    present = set(ids)
    state.urgency = {i: u for i, u in state.urgency.items() if i in present}
    state.admitted = {i for i in state.admitted if i in present} | {s.id for s in running}
    cap = state.prefill_cap if state.world == "WA" else None
    run = list(running)
    held: list[SeqRecord] = []
    promoted: list[int] = []
    logs: list[str] = []
    if not waiting and not run:
        return ScheduleOutcome(None, None, [], [], [], [], [], [], [], 0, 0, [])
    if not run:
        queue, discrete = list(waiting), True
        for i, s in enumerate(queue):
            (run if cap is None or i < cap else held).append(s)
    else:
        discrete = not waiting
        queue = sorted(waiting, key=lambda s: s.id)
        n_new = 0
        for s in queue:
            new = s.id not in state.admitted
            capped = new and cap is not None and n_new >= cap
            if len(run) + 1 <= state.max_seqs and not capped:
                run.append(s)
                n_new += new
            else:
                held.append(s)
    promoted = [s.id for s in run if s.id not in state.admitted]
    if (
        cap is not None
        and any(s.id not in state.admitted for s in held)
        and "cap" not in state.logged_once
    ):
        state.logged_once.add("cap")
        logs.append(f"ARC prefill cap: held a waiting sequence back at {len(promoted)} admitted "
                    f"this iteration (ARC_PREFILL_MAX_SEQS); logged once")
    state.admitted |= {s.id for s in run}
    b = bucket_and_waitlist_seqs_waiting(run, discrete, state)
    return ScheduleOutcome(
        key=b.key, discrete=discrete, running=b.chosen, waiting=held + b.waitlisted,
        completion=[s.id for s in b.chosen if not s.is_prompt],
        prompt=[s.id for s in b.chosen if s.is_prompt],
        waitlisted=[s.id for s in b.waitlisted], held=[s.id for s in held], promoted=promoted,
        n_buckets=b.n_buckets, offered=len(run), logs=logs + b.logs)


# --------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class CacheOp:
    """§18 cache instruction: kind "In" | "Nothing" | "Out" | "Reset" (Reset carries
    `load_preallocated_cache` and `reset_non_granular`)."""

    kind: str
    load_preallocated_cache: bool = False
    reset_non_granular: bool = False

    def __post_init__(self) -> None:
        require(self.kind in ("In", "Nothing", "Out", "Reset"), f"cache op kind {self.kind!r}")
        require(
            self.kind == "Reset" or not (self.load_preallocated_cache or self.reset_non_granular),
            f"only Reset carries flags, got {self}",
        )


IN = CacheOp("In")
NOTHING = CacheOp("Nothing")
OUT = CacheOp("Out")


def engine_cache_instruction(
    world: str,
    batch: str,
    ids: Sequence[int],
    last_completion_ids: Sequence[int],
    no_kv_cache: bool,
    granted: bool = False,
    first_token_offset: int = 0,
) -> tuple[CacheOp, CacheOp]:
    """§18 `(pre_op, post_op)` for one batch.
    completion, W0/WA: pre In iff `!no_kv and ids != last_completion_ids` (order-sensitive
      list compare), else Nothing; WB: pre In iff `issues_cache_in(no_kv, changed, granted)`.
    prompt: pre In iff the first prompt's `token_offset != 0`, else
      `Reset{load_preallocated_cache: True, reset_non_granular: False}`.
    post (both): Out, or `Reset{False, False}` when there is no KV cache."""
    require(world in WORLDS, f"world {world!r} must be one of {WORLDS}")
    require(batch in ("completion", "prompt"), f"batch {batch!r} must be 'completion' or 'prompt'")
    post = CacheOp("Reset") if no_kv_cache else OUT
    if batch == "prompt":
        pre = IN if first_token_offset != 0 else CacheOp("Reset", load_preallocated_cache=True)
        return pre, post
    # order-sensitive list compare; lists are compared as given (no copy: a batch may be 1000s long)
    changed = _as_list(ids) != _as_list(last_completion_ids)
    go_in = (
        issues_cache_in(no_kv_cache, changed, granted)
        if world == "WB"
        else (not no_kv_cache and changed)
    )
    return (IN if go_in else NOTHING), post


def _as_list(xs: Sequence[int]) -> list[int]:
    return xs if isinstance(xs, list) else list(xs)


@dataclass(frozen=True)
class EngineBatch:
    """One forward of an engine iteration: its kind, ids (running order) and instructions."""

    kind: str
    ids: list[int]
    pre_op: CacheOp
    post_op: CacheOp


def plan_engine_iteration(state: SchedulerState, outcome: ScheduleOutcome,
                          no_kv_cache: bool = False) -> list[EngineBatch]:
    """§20.1 steps 3-5: the completion forward (if any) then the prompt forward (if any),
    each with its §18 instructions; `last_completion_ids` becomes the completion ids after
    the completion batch and `[]` after a prompt batch (forcing In on the next decode).
    Refuses ("a grant must reach both") when the admission copies disagree."""
    check_admission_agrees(state)
    plan: list[EngineBatch] = []
    if outcome.completion:
        pre, post = engine_cache_instruction(state.world, "completion", outcome.completion,
                                             state.last_completion_ids, no_kv_cache,
                                             state.engine_admission.granted)
        plan.append(EngineBatch("completion", list(outcome.completion), pre, post))
        state.last_completion_ids = list(outcome.completion)
    if outcome.prompt:
        first = next(s for s in outcome.running if s.is_prompt)
        pre, post = engine_cache_instruction(state.world, "prompt", outcome.prompt, [], no_kv_cache,
                                             first_token_offset=first.token_offset)
        plan.append(EngineBatch("prompt", list(outcome.prompt), pre, post))
        state.last_completion_ids = []
    return plan


# --------------------------------------------------------------------------- WB law


def bucket_shattering_law(n: int, distinct: int, gap: int, steps: int,
                          admission: RaggedAdmission) -> tuple[int, int]:
    """§16 WB CPU simulation: `n` running completions with `100 + (i % distinct) * gap`
    tokens (no cache yet), `max_seqs = n`, `steps` calls of `schedule` in world WB, each
    chosen sequence gaining one token. Returns (sequences run over all steps, run in the
    last step). Refused with lengths far apart: n // distinct per step; granted: n."""
    require(n >= 1 and distinct >= 1 and gap >= 0 and steps >= 0,
            f"n {n}, distinct {distinct} must be >= 1; gap {gap}, steps {steps} >= 0")
    state = SchedulerState(world="WB", max_seqs=n)
    install_admission(state, admission)
    running = [SeqRecord(i, 100 + (i % distinct) * gap) for i in range(n)]
    waiting: list[SeqRecord] = []
    total = last = 0
    for _ in range(steps):
        out = schedule(running, waiting, state)
        last = out.chosen
        total += last
        running = [replace(s, n_tokens=s.n_tokens + 1) for s in out.running]
        waiting = out.waiting
    return total, last
