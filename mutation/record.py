"""The recorded mutmut results: `mutation/mutmut_record.json`, committed, one entry per module.

An entry holds the module's keys at its last run (mutmut_cache.module_key: `source_key` over
its source, its covering tests and the shared test helpers; `key` also over mutmut's version
and settings), the counts, the score,
the survivors, the date, the seconds it took and whether it passed the gate. Every run that
writes docs/mutation.md updates the entries of the modules it ran (unsharded, or the merge of
a sharded run) and the page's per-module table is rendered from the whole record, so a run
of some modules keeps the others' last results, each with its own date.

The CI gate (`--fast`) reads it: a module whose current source key equals its recorded one and
which passed is not mutated again; a module whose key changed is (and must then pass); a
module whose recorded run failed and which has not changed is listed, not run again (its
failure is the full run's to report); a module with no entry is listed as not recorded (the
CI gate does not cover it until a run records it).
"""

from __future__ import annotations

import json
from pathlib import Path

from raggedspec.mutation.mutmut_run import ModuleResult

RECORD = Path(__file__).resolve().parent / "mutmut_record.json"


def load_record(path: Path = RECORD) -> dict:
    """{"modules": {module: entry}}; an absent or unreadable file is an empty record."""
    try:
        data = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"modules": {}}
    data.setdefault("modules", {})
    return data


def entry_of(mod: ModuleResult, ok: bool, when: str) -> dict:
    return {"key": mod.key, "source_key": mod.source_key, "mutants": mod.mutants,
            "killed": mod.killed, "survived": mod.survived, "timeouts": mod.timeouts,
            "skipped": mod.skipped, "other": mod.other, "score": round(mod.score, 2), "ok": ok,
            "date": when,
            "seconds": round(mod.seconds, 1), "reused": mod.reused,
            **({"base": mod.base} if mod.base else {}),
            "survivors": [{k: s[k] for k in ("key", "function", "status", "line")}
                          for s in mod.survivors]}


def updated(record: dict, modules: dict[str, ModuleResult], ok_by_module: dict[str, bool],
            when: str) -> dict:
    """A copy of `record` with the entries of `modules` replaced by this run's."""
    out = {"modules": dict(record.get("modules", {}))}
    for name, mod in modules.items():
        out["modules"][name] = entry_of(mod, ok_by_module.get(name, False), when)
    out["modules"] = dict(sorted(out["modules"].items()))
    return out


def save_record(record: dict, path: Path = RECORD) -> None:
    Path(path).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def ci_plan(record: dict, keys: dict[str, str]) -> dict[str, str]:
    """{module: "unchanged" | "changed" | "failed" | "unrecorded"} for the modules with
    current source keys `keys` (`module_key(..., tool=False)`; see the module docstring for
    what the CI gate does with each)."""
    out = {}
    for module, key in keys.items():
        e = record.get("modules", {}).get(module)
        if e is None:
            out[module] = "unrecorded"
        elif e.get("source_key") != key:
            out[module] = "changed"
        elif not e.get("ok"):
            out[module] = "failed"
        else:
            out[module] = "unchanged"
    return out
