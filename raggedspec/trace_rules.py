"""The rules `raggedspec check-trace` checks, each named after the spec rule it reads.

A rule runs on every row or step it applies to that carries the fields it needs (`Rule.needs`);
its count of rows or steps checked says whether it ran. Rows of failed steps (an `error`) are
left out of the rules read within a step, but the lead identity: their outcome fields are zero
and their requests are over. The two advance rules are read across steps: a row's own length
at its next step against its own length at a decode or defer step that did not fail (a failed
step's lengths count when it assembled its batch, `In`, before failing: they were read off the
rows' own caches). The cache length a row verified at is its own length under per-sequence
advance and the batched width under the cohort rule (C §8.2, §16).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rule:
    """One checked rule: its short id, the spec rule it is named after, the invariant, and
    the trace fields it needs."""

    id: str
    spec: str
    invariant: str
    needs: tuple[str, ...]


RULES = (
    Rule(
        "lead",
        "front_align_batch (C §4.5)",
        "lead = width - own_len",
        ("rows[].width", "rows[].lead"),
    ),
    Rule(
        "uniform-no-lead",
        "resolve_row_cache_lens (C §8.2)",
        "a uniform batch has no lead, and some row of a batch has lead 0",
        ("rows[].lead",),
    ),
    Rule(
        "accepted-le-drafted",
        "verify_proposed (C §11.1)",
        "accepted <= drafted",
        ("rows[].drafted", "rows[].accepted"),
    ),
    Rule(
        "accepted-prefix",
        "verify_proposed (C §11.1)",
        "accepted_pos has one entry per draft and its accepted drafts are the first `accepted`",
        ("rows[].accepted_pos", "rows[].accepted"),
    ),
    Rule(
        "commit",
        "accept and commit (C §11.2)",
        "committed = accepted + 1 on a decode step (fewer only on the row's last step)",
        ("phase", "rows[].accepted", "rows[].committed"),
    ),
    Rule(
        "chain-start",
        "chain_start_of (C §9.1)",
        "chain_start = cache_len + u - 2 (cache_len: own_len under per-sequence advance, "
        "else width)",
        ("phase", "advance", "rows[].u", "rows[].chain_start"),
    ),
    Rule(
        "group-key",
        "draft_group_key (C §9.1)",
        "group = [u, 0] under per-sequence advance, else [u, cache_len + u - 2]",
        ("phase", "advance", "rows[].u", "rows[].group"),
    ),
    Rule(
        "group-count",
        "draft_groups (C §9.1)",
        "at most depth + 1 draft groups on a per-sequence step",
        ("phase", "advance", "groups", "depth"),
    ),
    Rule(
        "q0",
        "ragged_row_q0 (M §12)",
        "q0 = the row's own position: own_len under per-sequence advance and on a defer step, "
        "width on a cohort decode step, 0 on a prompt step",
        ("phase", "advance", "rows[].q0"),
    ),
    Rule(
        "dead-cols",
        "ragged_union_mask (M §5)",
        "the mask's dead-prefix columns = lead",
        ("rows[].dead_cols", "rows[].lead"),
    ),
    Rule(
        "per-sequence-advance",
        "plan_per_sequence_step (C §12.2)",
        "a row's next own_len = own_len + committed (u + accepted)",
        ("phase", "advance", "rows[].committed"),
    ),
    Rule(
        "cohort-advance",
        "plan_batch_step (C §12.1)",
        "every row of a cohort step advances by keep = min over rows of (u + accepted); a defer "
        "step by 1",
        ("phase", "advance"),
    ),
)
RULE_BY_ID = {r.id: r for r in RULES}


@dataclass
class Violation:
    """One broken rule at one step (and sequence). `origin` is the step whose outcome broke
    it: the step itself, or for an advance rule the earlier step the row advanced from."""

    step: int
    seq: object
    rule: str
    expected: object
    actual: object
    note: str = ""
    origin: int | None = None

    def order(self) -> tuple[int, int]:
        """Where the fault arose first: by `origin`, then by the step it shows at."""
        return (self.step if self.origin is None else self.origin, self.step)

    def line(self) -> str:
        r = RULE_BY_ID[self.rule]
        seq = "" if self.seq is None else f" seq {self.seq}"
        note = f" ({self.note})" if self.note else ""
        return (
            f"step {self.step}{seq}: {r.id} [{r.spec}]: expected {self.expected}, "
            f"actual {self.actual}{note}"
        )


@dataclass
class Report:
    """Per rule: how many rows or steps it checked (0 = did not run) and its violations."""

    checked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    violations: list[Violation] = field(default_factory=list)

    def record(self, rule: str, step: int, seq, out: Outcome | None,
               origin: int | None = None) -> None:
        """Count one application of `rule` (none when `out` is None) and keep a violation
        (`origin`: the step whose outcome it reads, when earlier than `step`)."""
        if out is None:
            return
        self.checked[rule] += 1
        if not out.holds:
            self.violations.append(
                Violation(step, seq, rule, out.expected, out.actual, out.note, origin))

    def in_order(self) -> list[Violation]:
        """The violations by where their fault arose (`Violation.order`): the first broken
        rule first, before the rules that broke only because of it at a later step."""
        return sorted(self.violations, key=Violation.order)

    def violated(self, rule: str) -> int:
        return sum(v.rule == rule for v in self.violations)


@dataclass(frozen=True)
class Outcome:
    """One application of a rule: whether it holds, and both sides for the report."""

    holds: bool
    expected: str
    actual: str
    note: str = ""


def _has(x: dict, *names: str) -> bool:
    return all(x.get(n) is not None for n in names)


def _failed(s: dict) -> bool:
    return bool(s.get("error"))


def position(s: dict, r: dict) -> int | None:
    """The cache length the row verified at: its own length under per-sequence advance, the
    batched width under the cohort rule (None when the step has no `advance`)."""
    if s.get("advance") is None:
        return None
    return r["own_len"] if s["advance"] == "per-sequence" else r.get("width")


# ------------------------------------------------------------------ rules on one row
# Each takes (step, row, last step of each sequence) and returns None where it does not apply.


def rule_lead(s: dict, r: dict, last: dict) -> Outcome | None:
    """`lead = width - own_len`, on every row with both (a failed step's too)."""
    if not _has(r, "width", "lead"):
        return None
    want = r["width"] - r["own_len"]
    return Outcome(
        r["lead"] == want,
        f"lead {want} (width {r['width']} - own_len {r['own_len']})",
        f"lead {r['lead']}",
    )


def rule_dead_cols(s: dict, r: dict, last: dict) -> Outcome | None:
    """The mask's dead-prefix columns equal the row's lead (a failed step's too)."""
    if not _has(r, "dead_cols", "lead"):
        return None
    return Outcome(
        r["dead_cols"] == r["lead"],
        f"dead_cols {r['lead']} (the lead)",
        f"dead_cols {r['dead_cols']}",
    )


def rule_accepted_le_drafted(s: dict, r: dict, last: dict) -> Outcome | None:
    """`accepted <= drafted` (verify_proposed accepts a prefix of the drafts)."""
    if _failed(s) or not _has(r, "drafted", "accepted"):
        return None
    return Outcome(
        r["accepted"] <= r["drafted"],
        f"accepted <= drafted {r['drafted']}",
        f"accepted {r['accepted']}",
    )


def rule_accepted_prefix(s: dict, r: dict, last: dict) -> Outcome | None:
    """`accepted_pos` has one entry per draft (when `drafted` is known), and its first
    `accepted` entries are 1, the rest 0."""
    if _failed(s) or not _has(r, "accepted_pos", "accepted"):
        return None
    bits, a = r["accepted_pos"], r["accepted"]
    if r.get("drafted") is not None and len(bits) != r["drafted"]:
        return Outcome(  # pragma: no mutate (None for False: both fail the rule)
            False, f"{r['drafted']} entries (drafted)", f"{len(bits)} entries")
    want = [1] * a + [0] * (len(bits) - a)
    return Outcome(bits == want, f"accepted_pos {want} (accepted {a})", f"accepted_pos {bits}")


def rule_commit(s: dict, r: dict, last: dict) -> Outcome | None:
    """On a decode step `committed = accepted + 1`; fewer only on the sequence's last step
    in the trace (it reached max_new_tokens or the budget)."""
    if _failed(s) or s.get("phase") != "decode" or not _has(r, "accepted", "committed"):
        return None
    want, got = r["accepted"] + 1, r["committed"]
    short = got < want  # pragma: no mutate (<= is the same: got == want holds before it counts)
    ok = got == want or (short and last.get(r["seq"]) == s["step"])
    note = "the sequence runs again later, so it did not finish" if short else ""
    return Outcome(ok, f"committed {want} (accepted {r['accepted']} + 1)", f"committed {got}", note)


def rule_chain_start(s: dict, r: dict, last: dict) -> Outcome | None:
    """On a decode step `chain_start = cache_len + u - 2` (`position`)."""
    pos = position(s, r)
    if _failed(s) or s.get("phase") != "decode" or pos is None or not _has(r, "u", "chain_start"):
        return None
    want = pos + r["u"] - 2
    return Outcome(
        r["chain_start"] == want,
        f"chain_start {want} (cache_len {pos} + u {r['u']} - 2)",
        f"chain_start {r['chain_start']}",
    )


def rule_group_key(s: dict, r: dict, last: dict) -> Outcome | None:
    """On a decode step the draft group key is `[u, 0]` under per-sequence advance, else
    `[u, cache_len + u - 2]`."""
    pos = position(s, r)
    if _failed(s) or s.get("phase") != "decode" or pos is None or not _has(r, "u", "group"):
        return None
    per_seq = s["advance"] == "per-sequence"
    want = [r["u"], 0] if per_seq else [r["u"], pos + r["u"] - 2]
    got = list(r["group"])
    return Outcome(got == want, f"group {want} ({s['advance']} advance)", f"group {got}")


def rule_q0(s: dict, r: dict, last: dict) -> Outcome | None:
    """`q0` is the row's own position: 0 on a prompt step, own_len on a defer step, else
    `position` (own_len per-sequence, width cohort)."""
    if _failed(s) or r.get("q0") is None or s.get("phase") is None:
        return None
    want = {"prompt": 0, "defer": r["own_len"]}.get(s["phase"], position(s, r))
    if want is None:
        return None
    return Outcome(
        r["q0"] == want, f"q0 {want} ({s['phase']}, {s.get('advance')} advance)", f"q0 {r['q0']}"
    )


ROW_RULES = {
    "lead": rule_lead,
    "dead-cols": rule_dead_cols,
    "accepted-le-drafted": rule_accepted_le_drafted,
    "accepted-prefix": rule_accepted_prefix,
    "commit": rule_commit,
    "chain-start": rule_chain_start,
    "group-key": rule_group_key,
    "q0": rule_q0,
}


# ----------------------------------------------------------------- rules on one step


def rule_uniform_no_lead(s: dict, depth: int | None) -> Outcome | None:
    """A batch whose rows hold one length has no lead; any batch has a row with lead 0
    (resolve_row_cache_lens refuses one without). Steps that did not fail, every row with
    a lead."""
    rows = s["rows"]
    if _failed(s) or not rows or any(r.get("lead") is None for r in rows):
        return None
    leads = [r["lead"] for r in rows]
    if len({r["own_len"] for r in rows}) == 1:
        return Outcome(
            not any(leads),
            f"leads all 0 (every row holds own_len {rows[0]['own_len']})",
            f"leads {leads}",
        )
    return Outcome(min(leads) == 0, "some lead 0 (the widest row)", f"leads {leads}")


def rule_group_count(s: dict, depth: int | None) -> Outcome | None:
    """At most depth + 1 draft groups on a per-sequence decode step that did not fail: the
    step's `groups`, else its rows' distinct group keys. Needs the depth (a scenario)."""
    if depth is None or _failed(s) or s.get("phase") != "decode":
        return None
    if s.get("advance") != "per-sequence":
        return None
    n = s.get("groups")
    if n is None:
        if not any("group" in r for r in s["rows"]):
            return None
        n = len({tuple(r["group"]) for r in s["rows"] if r.get("group") is not None})
    return Outcome(n <= depth + 1, f"at most {depth + 1} groups (depth {depth} + 1)", f"{n} groups")


STEP_RULES = {"uniform-no-lead": rule_uniform_no_lead, "group-count": rule_group_count}


# --------------------------------------------------------------- rules across steps


@dataclass
class Before:
    """A row at the decode or defer step it last ran (one that did not fail); `keep` is
    the step's cohort keep (None when unknown), `seen` the first advance observed from it
    (shared by the step's rows: empty until one of them runs again)."""

    step: dict
    row: dict
    keep: int | None
    seen: list


def cohort_keep(s: dict) -> int | None:
    """1 on a defer step; min over rows of `u + accepted` on a decode step whose rows all
    carry both; else None."""
    if s["phase"] == "defer":
        return 1
    rows = s["rows"]
    if rows and all(_has(r, "u", "accepted") for r in rows):
        return min(r["u"] + r["accepted"] for r in rows)
    return None


def rule_per_sequence_advance(b: Before, r: dict) -> Outcome | None:
    """After a per-sequence decode step a row's next own_len is its own_len there plus
    `u + accepted` (or `committed` when u / accepted are absent)."""
    ps, pr = b.step, b.row
    if ps["phase"] != "decode" or ps["advance"] != "per-sequence":
        return None
    if _has(pr, "u", "accepted"):
        adv, how = pr["u"] + pr["accepted"], f"u {pr['u']} + accepted {pr['accepted']}"
    elif pr.get("committed") is not None:
        adv, how = pr["committed"], f"committed {pr['committed']}"
    else:
        return None
    want = pr["own_len"] + adv
    return Outcome(
        r["own_len"] == want,
        f"own_len {want} (own_len {pr['own_len']} at step {ps['step']} + {how})",
        f"own_len {r['own_len']}",
    )


def rule_cohort_advance(b: Before, r: dict) -> Outcome | None:
    """After a cohort decode step every row's own_len grows by the step's keep (min over
    rows of u + accepted); after a defer step by 1. Without u / accepted: every row of the
    step by the same amount as the first row seen again."""
    ps, pr = b.step, b.row
    if ps["advance"] != "cohort" and ps["phase"] != "defer":
        return None
    got = r["own_len"] - pr["own_len"]
    if b.keep is not None:
        how = "defer: 1" if ps["phase"] == "defer" else "keep = min(u + accepted)"
        return Outcome(
            got == b.keep,
            f"own_len {pr['own_len'] + b.keep} (own_len "
            f"{pr['own_len']} at step {ps['step']} + {b.keep}, {how})",
            f"own_len {r['own_len']}",
        )
    if not b.seen:
        b.seen.append((r["seq"], got))
    first_seq, first_got = b.seen[0]
    return Outcome(
        got == first_got,
        f"advance {first_got} (as seq {first_seq} after step {ps['step']})",
        f"advance {got}",
    )


ADVANCE_RULES = {
    "per-sequence-advance": rule_per_sequence_advance,
    "cohort-advance": rule_cohort_advance,
}


# ------------------------------------------------------------------------ the driver


def check_rules(steps: list[dict], depth: int | None) -> Report:
    """Apply every rule to every row and step of `steps` (schema step dicts, in order).
    A row's advance is read at its next step when that step did not fail, or failed after
    assembling its batch (`In`, row width > 0: its lengths were read off the rows' caches).
    An advance violation is kept with the step the row advanced from as its origin, so that
    `Report.in_order` puts a wrong advance before what it caused at the next step."""
    rep = Report()
    last = {r["seq"]: s["step"] for s in steps for r in s["rows"]}
    before: dict = {}
    for s in steps:
        for r in s["rows"]:
            for rid, rule in ROW_RULES.items():
                rep.record(rid, s["step"], r["seq"], rule(s, r, last))
        for rid, rule in STEP_RULES.items():
            rep.record(rid, s["step"], None, rule(s, depth))
        read = not _failed(s) or s.get("cache_instruction") == "In"
        for r in s["rows"]:
            b = before.pop(r["seq"], None)
            if b is not None and read and (not _failed(s) or r.get("width")):
                for rid, rule in ADVANCE_RULES.items():
                    rep.record(rid, s["step"], r["seq"], rule(b, r), b.step["step"])
        if _failed(s) or s.get("phase") not in ("decode", "defer") or s.get("advance") is None:
            continue
        keep, seen = cohort_keep(s), []
        for r in s["rows"]:
            before[r["seq"]] = Before(s, r, keep, seen)
    return rep
