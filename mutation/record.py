"""The recorded mutmut results: `mutation/mutmut_record.json`, committed, one entry per module.

An entry holds the module's key (mutmut_cache.module_key: its source, its covering tests, the
shared test helpers, mutmut's version and settings) at its last run, the counts, the score,
the survivors, the date, the seconds it took and whether it passed the gate. Every run that
writes docs/mutation.md updates the entries of the modules it ran (unsharded, or the merge of
a sharded run) and the page's per-module table is rendered from the whole record, so a run
of some modules keeps the others' last results, each with its own date.

The CI gate (`--fast`) reads it: a module whose current key equals its recorded key and
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
    return {"key": mod.key, "mutants": mod.mutants, "killed": mod.killed,
            "survived": mod.survived, "timeouts": mod.timeouts, "skipped": mod.skipped,
            "other": mod.other, "score": round(mod.score, 2), "ok": ok, "date": when,
            "seconds": round(mod.seconds, 1), "reused": mod.reused,
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
    current `keys` (see the module docstring for what the CI gate does with each)."""
    out = {}
    for module, key in keys.items():
        e = record.get("modules", {}).get(module)
        if e is None:
            out[module] = "unrecorded"
        elif e.get("key") != key:
            out[module] = "changed"
        elif not e.get("ok"):
            out[module] = "failed"
        else:
            out[module] = "unchanged"
    return out
