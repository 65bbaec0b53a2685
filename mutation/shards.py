"""Shards of a mutation run and their merge.

`--shard K/N` gives one run a deterministic 1/N of the work. Catalogue entries: entry i
(0-based, in catalogue order within the scope) belongs to shard (i mod N) + 1, so shards
differ by at most one entry. mutmut modules: the modules of the scope, largest source first
(ties by path), each go to the shard with the fewest source bytes so far (ties to the lowest
K), so shards are balanced by size; the sizes are those of the tree the shard ran on, and
merge checks that every shard ran on the same tree.

Each shard writes its result as JSON (`--json PATH`, format `FORMAT`); `merge` checks the
shards (same format, commit, tree, N, scope, mode; each K from 1 to N exactly once; the
assigned work disjoint and complete) and combines them into one result, gated and written
into docs/mutation.md exactly as one unsharded run's result is. A refused merge raises
`MergeError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

FORMAT = 1
_SAME = ("format", "commit", "tree", "scope", "mode", "catalogue_all", "mutmut_all")
_TREE_PARTS = ("reference", "gpu", "conformance", "mutation")


class MergeError(Exception):
    """Shards that cannot be merged; the message names the file and the field."""


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 1 <= K <= N; ValueError otherwise."""
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 1 <= int(k) <= int(n):
        raise ValueError(f"--shard {text!r}: expected K/N with 1 <= K <= N")
    return int(k), int(n)


def catalogue_shard(names: list[str], k: int, n: int) -> list[str]:
    """The entries of shard k of n: index mod n."""
    return [name for i, name in enumerate(names) if i % n == k - 1]


def module_shards(sizes: dict[str, int], n: int) -> list[list[str]]:
    """The modules of each of the n shards (index 0 = shard 1), balanced by size: largest
    first, each to the lightest shard so far (ties to the lowest index); each list in path
    order."""
    load = [0] * n
    out: list[list[str]] = [[] for _ in range(n)]
    for module in sorted(sizes, key=lambda m: (-sizes[m], m)):
        i = min(range(n), key=lambda j: (load[j], j))
        out[i].append(module)
        load[i] += sizes[module]
    return [sorted(s) for s in out]


def module_shard(modules: list[str], root: Path, k: int, n: int) -> list[str]:
    sizes = {m: (root / m).stat().st_size if (root / m).is_file() else 0 for m in modules}
    return module_shards(sizes, n)[k - 1]


def git_commit(root: Path) -> str | None:
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def tree_hash(root: Path) -> str:
    """SHA-256 over the sources, tests and mutation config a run reads (.py, .cu, .toml under
    reference/, gpu/, conformance/, mutation/, and pyproject.toml)."""
    h = hashlib.sha256()
    files = [root / "pyproject.toml"] + sorted(
        p for part in _TREE_PARTS for p in (root / part).rglob("*")
        if p.is_file() and p.suffix in (".py", ".cu", ".toml") and "__pycache__" not in p.parts)
    for f in files:
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def load_result(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path}: not a readable JSON result ({exc})") from exc
    if not isinstance(data, dict):
        raise MergeError(f"{path}: not a JSON object")
    for fld in (*_SAME, "shard", "catalogue_assigned", "mutmut_assigned"):
        if fld not in data:
            raise MergeError(f"{path}: field '{fld}' is missing (not a shard result of this "
                             f"runner?)")
    return data


def merge_results(paths: list[Path]) -> dict:
    """One result from the shard results at `paths` (see the module docstring); MergeError
    when they overlap, one is missing, or they come from different trees, commits or N."""
    if not paths:
        raise MergeError("no shard results given")
    shards = [(Path(p), load_result(p)) for p in paths]
    first_path, first = shards[0]
    if first["format"] != FORMAT:
        raise MergeError(f"{first_path}: field 'format' is {first['format']}, this runner "
                         f"reads {FORMAT}")
    n = first["shard"][1]
    for path, data in shards[1:]:
        for fld in _SAME:
            if data[fld] != first[fld]:
                raise MergeError(f"{path}: field '{fld}' differs from {first_path}'s "
                                 f"({_short(data[fld])} vs {_short(first[fld])})")
        if data["shard"][1] != n:
            raise MergeError(f"{path}: field 'shard' is {data['shard'][0]}/{data['shard'][1]}, "
                             f"{first_path} is of {n} shards")
    by_k: dict[int, Path] = {}
    for path, data in shards:
        k = data["shard"][0]
        if k in by_k:
            raise MergeError(f"{path}: field 'shard': shard {k}/{n} is also {by_k[k]}")
        by_k[k] = path
    missing = [k for k in range(1, n + 1) if k not in by_k]
    if missing:
        raise MergeError(f"field 'shard': shard(s) {', '.join(f'{k}/{n}' for k in missing)} "
                         f"missing (given: {', '.join(str(p) for p, _ in shards)})")
    for fld, all_fld in (("catalogue_assigned", "catalogue_all"), ("mutmut_assigned",
                                                                     "mutmut_all")):
        owner: dict[str, Path] = {}
        for path, data in shards:
            for item in data[fld]:
                if item in owner:
                    raise MergeError(f"{path}: field '{fld}': {item!r} is also in "
                                     f"{owner[item]} (shards overlap)")
                owner[item] = path
        absent = [x for x in first[all_fld] if x not in owner]
        extra = [x for x in owner if x not in first[all_fld]]
        if absent or extra:
            raise MergeError(f"{first_path}: field '{fld}': the shards do not cover "
                             f"'{all_fld}' (absent {absent[:5]}, unknown {extra[:5]})")
    out = {k: first[k] for k in (*_SAME, "threshold", "allow_red", "command", "date")
           if k in first}
    out["shard"] = [1, 1]
    out["shards"] = n
    out["catalogue_assigned"] = list(first["catalogue_all"])
    out["mutmut_assigned"] = list(first["mutmut_all"])
    order = {name: i for i, name in enumerate(first["catalogue_all"])}
    cats = [r for _, d in shards for r in d.get("catalogue") or []]
    out["catalogue"] = (sorted(cats, key=lambda r: order.get(r["name"], len(order)))
                        if any(d.get("catalogue") is not None for _, d in shards) else None)
    mods = {m: r for _, d in shards for m, r in ((d.get("mutmut") or {}).get("modules") or {})
            .items()}
    out["mutmut"] = ({"modules": dict(sorted(mods.items()))}
                     if any(d.get("mutmut") is not None for _, d in shards) else None)
    out["baseline_red"] = sorted({t for _, d in shards for t in d.get("baseline_red", [])})
    out["infra"] = [x for _, d in shards for x in d.get("infra", [])]
    out["ci"] = {"reasons": sorted({x for _, d in shards
                                    for x in (d.get("ci") or {}).get("reasons", [])})}
    out["seconds"] = max(float(d.get("seconds", 0.0)) for _, d in shards)
    out["seconds_total"] = sum(float(d.get("seconds", 0.0)) for _, d in shards)
    out["mutmut_seconds"] = max(float(d.get("mutmut_seconds", 0.0)) for _, d in shards)
    return out


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."
