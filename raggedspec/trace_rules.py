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
    step: int
    seq: object
    rule: str
    expected: object
    actual: object
    note: str = ""

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
    missing: dict[str, list[str]] = field(default_factory=dict)

    def bad(self, step, seq, rule, expected, actual, note="") -> None:
        self.violations.append(Violation(step, seq, rule, expected, actual, note))

    def violated(self, rule: str) -> int:
        return sum(v.rule == rule for v in self.violations)


# ----------------------------------------------------------------------- the rules


def _has(x: dict, *names: str) -> bool:
    return all(x.get(n) is not None for n in names)


def _position(step: dict, row: dict) -> int | None:
    """The row's own position (its cache length at verify): own_len under per-sequence
    advance, the batched width under the cohort rule."""
    if step.get("advance") == "per-sequence":
        return row["own_len"]
    return row.get("width")


def check_rows(steps: list[dict], last_step_of: dict, rep: Report) -> None:
    """The rules read within one row or one step."""
    for s in steps:
        t, rows, phase, failed = s["step"], s["rows"], s.get("phase"), bool(s.get("error"))
        for r in rows:
            q = r["seq"]
            if _has(r, "width", "lead"):
                rep.checked["lead"] += 1
                if r["lead"] != r["width"] - r["own_len"]:
                    rep.bad(
                        t,
                        q,
                        "lead",
                        f"lead {r['width'] - r['own_len']} (width {r['width']} - "
                        f"own_len {r['own_len']})",
                        f"lead {r['lead']}",
                    )
            if _has(r, "dead_cols", "lead"):
                rep.checked["dead-cols"] += 1
                if r["dead_cols"] != r["lead"]:
                    rep.bad(
                        t,
                        q,
                        "dead-cols",
                        f"dead_cols {r['lead']} (the lead)",
                        f"dead_cols {r['dead_cols']}",
                    )
            if failed:
                continue
            if _has(r, "drafted", "accepted"):
                rep.checked["accepted-le-drafted"] += 1
                if r["accepted"] > r["drafted"]:
                    rep.bad(
                        t,
                        q,
                        "accepted-le-drafted",
                        f"accepted <= drafted {r['drafted']}",
                        f"accepted {r['accepted']}",
                    )
            if _has(r, "accepted_pos", "accepted"):
                _check_prefix(t, r, rep)
            if phase == "decode" and _has(r, "accepted", "committed"):
                rep.checked["commit"] += 1
                want = r["accepted"] + 1
                last = last_step_of.get(q) == t
                if r["committed"] > want or (r["committed"] < want and not last):
                    why = (
                        ""
                        if r["committed"] > want
                        else "the sequence runs again later, so it did not finish"
                    )
                    rep.bad(
                        t,
                        q,
                        "commit",
                        f"committed {want} (accepted {r['accepted']} + 1)",
                        f"committed {r['committed']}",
                        why,
                    )
            _check_positions(s, r, rep)
        if not failed:
            _check_step_leads(s, rep)


def _check_prefix(t: int, r: dict, rep: Report) -> None:
    bits, a = r["accepted_pos"], r["accepted"]
    rep.checked["accepted-prefix"] += 1
    want = [1] * a + [0] * (len(bits) - a)
    if r.get("drafted") is not None and len(bits) != r["drafted"]:
        rep.bad(
            t,
            r["seq"],
            "accepted-prefix",
            f"{r['drafted']} entries (drafted)",
            f"{len(bits)} entries",
        )
    elif bits != want[: len(bits)] or a > len(bits):
        rep.bad(
            t,
            r["seq"],
            "accepted-prefix",
            f"accepted_pos {want} (accepted {a})",
            f"accepted_pos {bits}",
        )


def _check_positions(s: dict, r: dict, rep: Report) -> None:
    """chain-start, group-key and q0 of one row of a step that did not fail."""
    t, q, phase = s["step"], r["seq"], s.get("phase")
    if s.get("advance") is None or phase is None:
        return
    pos = _position(s, r)
    if phase == "decode" and pos is not None and r.get("u") is not None:
        start = pos + r["u"] - 2
        if r.get("chain_start") is not None:
            rep.checked["chain-start"] += 1
            if r["chain_start"] != start:
                rep.bad(
                    t,
                    q,
                    "chain-start",
                    f"chain_start {start} (cache_len {pos} + u {r['u']} - 2)",
                    f"chain_start {r['chain_start']}",
                )
        if r.get("group") is not None:
            rep.checked["group-key"] += 1
            key = [r["u"], 0] if s["advance"] == "per-sequence" else [r["u"], start]
            if list(r["group"]) != key:
                rep.bad(
                    t,
                    q,
                    "group-key",
                    f"group {key} ({s['advance']} advance)",
                    f"group {list(r['group'])}",
                )
    if r.get("q0") is not None:
        want = {"prompt": 0, "defer": r["own_len"]}.get(phase, pos)
        if want is not None:
            rep.checked["q0"] += 1
            if r["q0"] != want:
                rep.bad(t, q, "q0", f"q0 {want} ({phase}, {s['advance']} advance)", f"q0 {r['q0']}")


def _check_step_leads(s: dict, rep: Report) -> None:
    rows = s["rows"]
    if not rows or any(r.get("lead") is None for r in rows):
        return
    rep.checked["uniform-no-lead"] += 1
    leads = [r["lead"] for r in rows]
    if len({r["own_len"] for r in rows}) == 1 and any(leads):
        rep.bad(
            s["step"],
            None,
            "uniform-no-lead",
            f"leads all 0 (every row holds own_len {rows[0]['own_len']})",
            f"leads {leads}",
        )
    elif min(leads) > 0:
        rep.bad(
            s["step"], None, "uniform-no-lead", "some lead 0 (the widest row)", f"leads {leads}"
        )


def check_group_count(steps: list[dict], depth: int | None, rep: Report) -> None:
    """At most depth + 1 draft groups on a per-sequence decode step (step `groups`, or the
    distinct row group keys when the step has no `groups`)."""
    if depth is None:
        return
    for s in steps:
        if s.get("phase") != "decode" or s.get("advance") != "per-sequence" or s.get("error"):
            continue
        n = s.get("groups")
        if n is None:
            keys = {tuple(r["group"]) for r in s["rows"] if r.get("group") is not None}
            if not any("group" in r for r in s["rows"]):
                continue
            n = len(keys)
        rep.checked["group-count"] += 1
        if n > depth + 1:
            rep.bad(
                s["step"],
                None,
                "group-count",
                f"at most {depth + 1} groups (depth {depth} + 1)",
                f"{n} groups",
            )


def check_advance(steps: list[dict], rep: Report) -> None:
    """The two advance rules, across steps: a row's own_len at its next step against its
    own_len at a decode / defer step that did not fail."""
    prev: dict = {}  # seq -> (step dict, row dict, cohort keep or None)
    for s in steps:
        failed = bool(s.get("error"))
        # a failed step's lengths count when it assembled its batch (`In`) before failing:
        # they were read off the rows' own caches (width 0: it failed before reading them)
        read = not failed or s.get("cache_instruction") == "In"
        for r in s["rows"]:
            q = r["seq"]
            if q in prev and read and (not failed or r.get("width")):
                _compare_advance(prev[q], s, r, rep)
            prev.pop(q, None)
        if failed or s.get("phase") not in ("decode", "defer") or s.get("advance") is None:
            continue
        keep = _cohort_keep(s)
        for r in s["rows"]:
            prev[r["seq"]] = (s, r, keep)


def _cohort_keep(s: dict) -> int | None:
    if s["phase"] == "defer":
        return 1
    rows = s["rows"]
    if rows and all(_has(r, "u", "accepted") for r in rows):
        return min(r["u"] + r["accepted"] for r in rows)
    return None


def _compare_advance(before: tuple, s: dict, r: dict, rep: Report) -> None:
    ps, pr, keep = before
    q, got = r["seq"], r["own_len"]
    if ps["phase"] == "decode" and ps["advance"] == "per-sequence":
        if _has(pr, "u", "accepted"):
            adv, how = pr["u"] + pr["accepted"], f"u {pr['u']} + accepted {pr['accepted']}"
        elif pr.get("committed") is not None:
            adv, how = pr["committed"], f"committed {pr['committed']}"
        else:
            return
        rep.checked["per-sequence-advance"] += 1
        if got != pr["own_len"] + adv:
            rep.bad(
                s["step"],
                q,
                "per-sequence-advance",
                f"own_len {pr['own_len'] + adv} "
                f"(own_len {pr['own_len']} at step {ps['step']} + {how})",
                f"own_len {got}",
            )
        return
    if ps["advance"] != "cohort" and ps["phase"] != "defer":
        return
    rep.checked["cohort-advance"] += 1
    if keep is not None:
        if got != pr["own_len"] + keep:
            how = "defer: 1" if ps["phase"] == "defer" else "keep = min(u + accepted)"
            rep.bad(
                s["step"],
                q,
                "cohort-advance",
                f"own_len {pr['own_len'] + keep} (own_len {pr['own_len']} at step {ps['step']} + "
                f"{keep}, {how})",
                f"own_len {got}",
            )
        return
    first = ps.setdefault("_advance_seen", (q, got - pr["own_len"]))
    if got - pr["own_len"] != first[1]:
        rep.bad(
            s["step"],
            q,
            "cohort-advance",
            f"advance {first[1]} (as seq {first[0]} after step {ps['step']})",
            f"advance {got - pr['own_len']}",
        )
