"""Regenerate the generated parts of docs/vectors.md from freshly written vectors.

`python scripts/vectors_doc.py` (from the repository root) writes the default set and the
`--cases 100` set to temporary folders, then rewrites, in docs/vectors.md: the size
paragraph (between `<!-- begin generated: size -->` and `<!-- end generated: size -->`), the
function table (`... generated: functions ...`), every case shown whole (the ```json block
after `<!-- example: <family>/<function>/<case> -->`) and every tensor shown (the block after
`<!-- tensor: <case path> <name> -->`). Everything else is prose and is left alone.
`conformance/test_vectors.py` calls `render` without sizes and checks the page is unchanged,
so the shown cases and the table cannot drift from the generator.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "vectors.md"


def _section(doc: str, name: str, body: str) -> str:
    begin, end = f"<!-- begin generated: {name} -->\n", f"<!-- end generated: {name} -->"
    pattern = re.escape(begin) + r".*?" + re.escape(end)
    if not re.search(pattern, doc, re.DOTALL):
        raise ValueError(f"docs/vectors.md has no generated section {name!r}")
    return re.sub(pattern, lambda _m: begin + body + end, doc, flags=re.DOTALL)


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+$", ".<i>", name)


def function_table(root: Path) -> str:
    """The markdown table of every manifest function: its inputs, outputs and case counts."""
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    rows = [
        "| function | spec | reference | JSON inputs | tensor inputs | outputs | cases |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in manifest["functions"]:
        ji, ti, jo, to = set(), {}, set(), {}
        for case in sorted((root / e["family"] / e["function"]).glob("*/case.json")):
            c = json.loads(case.read_text(encoding="utf-8"))
            ji |= set(c["inputs"])
            ti.update({_pattern(k): v["dtype"] for k, v in c["tensor_inputs"].items()})
            jo |= {_pattern(k) for k in c["outputs"]}
            to.update(
                {_pattern(k): (v["dtype"], v["compare"]) for k, v in c["tensor_outputs"].items()}
            )
        outs = [f"`{k}`" for k in sorted(jo - set(to))]
        outs += [f"**`{k}`** {dt} {cmp}" for k, (dt, cmp) in sorted(to.items())]
        tin = ", ".join(f"`{k}` {v}" for k, v in sorted(ti.items())) or "—"
        x = e["expect"]
        rows.append(
            f"| `{e['family']}/{e['function']}` | {e['spec']} | `{e['reference']}` | "
            f"{', '.join(f'`{k}`' for k in sorted(ji))} | {tin} | {', '.join(outs) or '—'} | "
            f"{e['cases']} ({x['outputs']} / {x['refusal']} / {x['malformed']}) |"
        )
    return "\n".join(rows) + "\n"


def tensor_lines(root: Path, path: str, name: str) -> str:
    """A small 4-d tensor of the case as one line per `[i, j, k, :]` row."""
    from safetensors.numpy import load_file

    t = load_file(str(root / path / "outputs.safetensors"))[name]
    lines = []
    for idx in np.ndindex(*t.shape[:-1]):
        cells = ", ".join("-inf" if v == -np.inf else f"{v:g}" for v in t[idx])
        lines.append(f"{name}[{', '.join(map(str, idx))}, :] = [{cells}]")
    return "\n".join(lines) + "\n"


def render(doc: str, root: Path, sizes: dict | None = None) -> str:
    """`doc` with its generated parts taken from the vectors under `root`; the size paragraph
    only when `sizes` (from `measure`) is given."""
    doc = _section(doc, "functions", function_table(root))

    def case_block(m: re.Match) -> str:
        text = (root / m.group(1) / "case.json").read_text(encoding="utf-8")
        return f"{m.group(0).split(chr(10))[0]}\n```json\n{text}```"

    doc = re.sub(r"<!-- example: (\S+) -->\n```json\n.*?```", case_block, doc, flags=re.DOTALL)

    def tensor_block(m: re.Match) -> str:
        lines = tensor_lines(root, m.group(1), m.group(2))
        return f"<!-- tensor: {m.group(1)} {m.group(2)} -->\n```\n{lines}```"

    doc = re.sub(r"<!-- tensor: (\S+) (\S+) -->\n```\n.*?```", tensor_block, doc, flags=re.DOTALL)
    if sizes is not None:
        doc = _section(doc, "size", size_paragraph(sizes))
    return doc


def measure(cases: int, out: Path) -> dict:
    """Write `cases` generated cases per function to `out`; its case count, bytes, files."""
    run = [sys.executable, "-m", "raggedspec", "vectors", "--out", str(out), "--cases", str(cases)]
    subprocess.run(run, cwd=ROOT, check=True, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    files = [p for p in out.rglob("*") if p.is_file()]
    du = subprocess.run(["du", "-sh", str(out)], capture_output=True, text=True, check=True)
    return {
        "cases": manifest["case_count"],
        "functions": len(manifest["functions"]),
        "bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
        "du": du.stdout.split()[0],
    }


def size_paragraph(sizes: dict) -> str:
    d, m = sizes[8], sizes[100]

    def n(x: int) -> str:
        return f"{x:,}".replace(",", " ")

    du = f"{d['du'][:-1]} {d['du'][-1]}B"
    return (
        "Size of the default set (`raggedspec vectors --out DIR`, measured by\n"
        "`python scripts/vectors_doc.py`, which sums the files' bytes):\n"
        f"{n(d['cases'])} cases of {d['functions']} functions, {n(d['bytes'])} bytes "
        f"({d['bytes'] / 1e6:.1f} MB) in {d['files']} files\n"
        f"(`du -sh` shows {du} on the disk it was measured on, where every file and folder\n"
        f"takes at least one block). `--cases 100`: {n(m['cases'])} cases, {n(m['bytes'])} bytes\n"
        f"({m['bytes'] / 1e6:.1f} MB) in {m['files']} files.\n"
    )


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {n: measure(n, Path(tmp) / f"v{n}") for n in (8, 100)}
        DOC.write_text(
            render(DOC.read_text(encoding="utf-8"), Path(tmp) / "v8", sizes), encoding="utf-8"
        )
    print(f"rewrote the generated parts of {DOC.relative_to(ROOT)}: {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
