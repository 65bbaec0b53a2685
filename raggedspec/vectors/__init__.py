"""Language-neutral test vectors: `raggedspec vectors --out DIR`.

Every vector function (`registry.Fn`; the length, policy, bookkeeping, tensor and K/V slot
rules of the `*_fns` modules) is run on the reference over its cases, and each case is
written as `DIR/<family>/<function>/<case>/case.json` (JSON inputs, the expected JSON
outputs or the expected refusal, the comparison rule and tolerance of each tensor output)
plus `inputs.safetensors` / `outputs.safetensors` when tensors are involved.
`DIR/manifest.json` lists every function with its spec section, case counts and content
hash, and each function's folder holds `schema.json`, the JSON Schema of its case files
(`schema`, from the declarations in `shapes`). The same arguments give a byte-identical
folder: JSON is written with sorted keys, cases are drawn from a generator seeded by
`(seed, crc32(family/function))` only, and no time, path or host detail is recorded.
docs/vectors.md describes the format, the hash recipe and the comparison rules.

Writing is atomic: the folder is built in a temporary sibling and renamed into place. An
existing `DIR` is replaced only when it is empty or a previous vectors folder (its manifest
says `"format": "raggedspec-vectors"`); anything else is refused, and nothing is clobbered.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import importlib.util
import json
import re
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

from raggedspec import __version__
from raggedspec.exits import EXIT_OK, UsageError
from raggedspec.vectors.align_fns import align_functions
from raggedspec.vectors.bookkeeping_fns import bookkeeping_functions
from raggedspec.vectors.length_fns import length_functions
from raggedspec.vectors.policy_fns import policy_functions
from raggedspec.vectors.registry import Fn
from raggedspec.vectors.schema import case_schema
from raggedspec.vectors.shapes import SHAPES
from raggedspec.vectors.tensor_fns import tensor_functions
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.errors import Refusal

FORMAT = "raggedspec-vectors"
SCHEMA_VERSION = 2
DEFAULT_CASES = 8
# elementwise |got - want| <= atol + rtol * |want| for "close" tensor outputs, by the float
# dtype the implementation under test computes in (infinities must match exactly); dtypes are
# spelled as in the safetensors header everywhere (DTYPE_CODES)
TOLERANCE = {
    "F64": {"rtol": 1e-12, "atol": 1e-12},
    "F32": {"rtol": 1e-5, "atol": 1e-5},
    "BF16": {"rtol": 2e-2, "atol": 2e-2},
}
DTYPE_CODES = {"float64": "F64", "float32": "F32", "int64": "I64", "int32": "I32", "bool": "BOOL"}
CLOSE = {
    "rope/apply_rope",
    "attention/dsv4_attention",
}  # float arithmetic; every other tensor is exact


def functions() -> list[Fn]:
    """Every vector function, in manifest order (length rules, policy rules, bookkeeping,
    masks / RoPE / attention, K/V slots), each with its JSON shape from `shapes.SHAPES`."""
    fns = (
        length_functions()
        + policy_functions()
        + bookkeeping_functions()
        + tensor_functions()
        + align_functions()
    )
    return [dataclasses.replace(fn, **SHAPES[fn.key]) for fn in fns]


def select(pattern: str | None) -> list[Fn]:
    """The functions whose `family/function` matches the glob `pattern` (None: all).
    Refuses (ValueError naming the pattern) a pattern that matches nothing."""
    fns = functions()
    if pattern is None:
        return fns
    chosen = [
        f
        for f in fns
        if fnmatch.fnmatchcase(f.key, pattern) or fnmatch.fnmatchcase(f.family, pattern)
    ]
    if not chosen:
        families = sorted({f.family for f in fns})
        raise ValueError(
            f"--rules {pattern!r} matches no vector function (families: {', '.join(families)}; "
            "patterns are globs on family/function, e.g. 'masks/*')"
        )
    return chosen


def _plain(x):
    """JSON form of an output or input value (tuples -> lists, NumPy scalars -> Python)."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    return x


def _split(values: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """`values` as (JSON part, tensors): NumPy arrays go to the tensors."""
    js, tensors = {}, {}
    for k, v in values.items():
        if isinstance(v, np.ndarray):
            tensors[k] = np.ascontiguousarray(v)
        else:
            js[k] = _plain(v)
    return js, tensors


def _tensor_meta(tensors: dict[str, np.ndarray], compare: str | None = None) -> dict:
    meta = {}
    for k, a in sorted(tensors.items()):
        meta[k] = {"dtype": DTYPE_CODES[str(a.dtype)], "shape": list(a.shape)}
        if compare is not None:
            meta[k]["compare"] = compare if a.dtype.kind == "f" else "exact"
    return meta


VALUE = re.compile(r"`([^`]+)`|(?<![\w.])(-?\d+)(?![\w]|\.\d)")


def message_values(message: str) -> list[int | str]:
    """The values a refusal message names, in order: each whole integer (not a digit inside
    a word such as V4) and each `backticked` name. A consumer with its own wording matches a
    refusal by its class and these values."""
    return [int(n) if n else name for name, n in VALUE.findall(message)]


def _raised(kind: str, cls: str, message: str) -> dict:
    return {
        "raises": {
            "kind": kind,
            "class": cls,
            "message": message,
            "values": message_values(message),
        }
    }


def run_case(fn: Fn, inputs: dict, backend: object | None = None) -> dict:
    """The expected result of one case on the reference: `{"outputs", "tensors"}` or
    `{"raises": {"kind", "class", "message", "values"}}` (kind "refusal" for a `Refusal`,
    "malformed" for a ValueError; `values` from `message_values`)."""
    backend = backend or NumpyBackend()
    try:
        out = fn.call(backend, dict(inputs))
    except Refusal as exc:
        return _raised("refusal", type(exc).__name__, str(exc))
    except ValueError as exc:
        return _raised("malformed", "ValueError", str(exc))
    js, tensors = _split(out)
    return {"outputs": js, "tensors": tensors}


def case_files(fn: Fn, name: str, inputs: dict) -> dict[str, bytes]:
    """The files of one case: `case.json` and, where tensors are involved,
    `inputs.safetensors` / `outputs.safetensors`."""
    from safetensors.numpy import save

    js_in, t_in = _split(inputs)
    result = run_case(fn, inputs)
    case = {
        "schema_version": SCHEMA_VERSION,
        "family": fn.family,
        "function": fn.name,
        "case": name,
        "spec": fn.spec,
        "inputs": js_in,
        "tensor_inputs": _tensor_meta(t_in),
        "policy": [],
    }
    files = {}
    if t_in:
        files["inputs.safetensors"] = save(t_in)
    if "raises" in result:
        case.update(
            expect=result["raises"]["kind"], raises=result["raises"], outputs={}, tensor_outputs={}
        )
        if name in fn.policy_cases:
            case["policy"] = ["raises"]
    else:
        compare = "close" if fn.key in CLOSE else "exact"
        t_out = result["tensors"]
        case.update(
            expect="outputs",
            raises=None,
            outputs=result["outputs"],
            tensor_outputs=_tensor_meta(t_out, compare),
            policy=[k for k in fn.policy if k in result["outputs"] or k in t_out],
        )
        if t_out:
            files["outputs.safetensors"] = save(t_out)
        if compare == "close" and any(a.dtype.kind == "f" for a in t_out.values()):
            case["tolerance"] = TOLERANCE
    files["case.json"] = _json_bytes(case)
    return files


def _json_bytes(value) -> bytes:
    return (
        json.dumps(value, indent=1, sort_keys=True, allow_nan=False, ensure_ascii=False) + "\n"
    ).encode("utf-8")


def function_hash(files: dict[str, bytes]) -> str:
    """A function's hash (docs/vectors.md): SHA-256 over its files sorted by their path
    relative to the vectors folder, each contributing `path`, a NUL byte and the 32-byte
    SHA-256 digest of its content."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    return h.hexdigest()


def _rng(seed: int, fn: Fn) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(fn.key.encode())])


def build(out: Path, fns: list[Fn], cases: int, seed: int) -> dict:
    """Write every case of `fns` under `out` (an empty folder) and the manifest; returns it."""
    entries, digest = [], hashlib.sha256()
    for fn in fns:
        listed = fn.cases(_rng(seed, fn), cases)
        names = [n for n, _ in listed]
        if len(set(names)) != len(names):
            raise AssertionError(f"{fn.key}: duplicate case names")
        counts = {"outputs": 0, "refusal": 0, "malformed": 0}
        written = {f"{fn.key}/schema.json": _json_bytes(case_schema(fn, SCHEMA_VERSION))}
        for name, inputs in listed:
            files = case_files(fn, name, inputs)
            counts[json.loads(files["case.json"])["expect"]] += 1
            written |= {f"{fn.key}/{name}/{fname}": data for fname, data in files.items()}
        for rel, data in written.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(data)
        entries.append(
            {
                "family": fn.family,
                "function": fn.name,
                "spec": fn.spec,
                "reference": fn.reference,
                "cases": len(listed),
                "case_names": sorted(names),
                "expect": counts,
                "policy": list(fn.policy),
                "schema": f"{fn.key}/schema.json",
                "hash": function_hash(written),
            }
        )
        digest.update(f"{fn.key}\0{entries[-1]['hash']}\n".encode())
    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "raggedspec_version": __version__,
        "arguments": {"cases": cases, "seed": seed},
        "tolerance": TOLERANCE,
        "case_count": sum(e["cases"] for e in entries),
        "functions": entries,
        "content_hash": digest.hexdigest(),
    }
    text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    (out / "manifest.json").write_bytes(text.encode("utf-8"))
    return manifest


def is_vectors_folder(path: Path) -> bool:
    """True iff `path/manifest.json` is a vectors manifest (a folder `write` may replace)."""
    try:
        return json.loads((path / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write(out: Path, rules: str | None = None, cases: int = DEFAULT_CASES, seed: int = 0) -> dict:
    """Generate the vectors into `out` atomically; returns the manifest. ValueError (naming
    the path or argument) for `cases < 0`, a `rules` pattern that matches nothing, or an `out`
    that exists and is neither an empty folder nor a previous vectors folder."""
    if cases < 0:
        raise ValueError(f"--cases {cases}: must be >= 0")
    if importlib.util.find_spec("safetensors") is None:
        raise ValueError(
            "raggedspec vectors writes safetensors files: pip install 'raggedspec[vectors]'"
        )
    fns = select(rules)
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise ValueError(f"--out {out}: exists and is not a folder; refusing to replace it")
        if any(out.iterdir()) and not is_vectors_folder(out):
            raise ValueError(
                f"--out {out}: a non-empty folder that is not a vectors folder (no manifest.json "
                f"with format {FORMAT!r}); refusing to write into it"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        new = tmp / "new"
        new.mkdir()
        manifest = build(new, fns, cases, seed)
        if out.exists():
            out.rename(tmp / "old")
        new.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def folder_size(path: Path) -> int:
    """Total bytes of the files under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `vectors` subcommand's parser."""
    p = sub.add_parser(
        "vectors",
        help="write language-neutral test vectors (JSON + safetensors) of every rule",
        description="Write test vectors: per rule family and function, the spec's worked "
        "examples, its "
        "refusals and seeded generated cases, as DIR/<family>/<function>/<case>/case.json "
        "(+ inputs.safetensors / outputs.safetensors) and DIR/manifest.json. The same "
        "arguments give a byte-identical folder. See docs/vectors.md.",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="output folder (created; replaced only if empty or a previous vectors folder)",
    )
    p.add_argument(
        "--rules", default=None, help="glob on family/function, e.g. 'masks/*' (default: all)"
    )
    p.add_argument(
        "--cases",
        type=int,
        default=DEFAULT_CASES,
        help=f"generated cases per function, on top of the examples and refusals (default "
        f"{DEFAULT_CASES})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated cases (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run `raggedspec vectors`: exit 0 after writing; bad arguments raise the CLI's UsageError."""
    try:
        manifest = write(args.out, args.rules, args.cases, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(
        f"wrote {manifest['case_count']} cases of {len(manifest['functions'])} functions "
        f"to {args.out} "
        f"({folder_size(args.out)} bytes, content hash {manifest['content_hash'][:16]})"
    )
    return EXIT_OK
