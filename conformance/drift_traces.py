"""A hand-made engine for the drift tests: a few lines that write schema-v1 traces of their
own (JSONL or CSV), as another engine would log them, and the §17.3 length sequences.
They prove a user's engine trace plots, and they are the oracle's input. Also the tests'
readers of a drawn figure: its words (`figure_text`) and what reaches outside its canvas.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

# the schema's CSV columns (docs/trace.md) this engine logs: one line per row
CSV_COLUMNS = [
    "step", "phase", "advance", "cache_instruction", "running", "waiting", "buckets", "groups",
    "padding_fraction", "tok_per_step", "seq", "row", "own_len", "width", "lead", "u",
    "drafted", "accepted", "committed", "group_u", "group_start", "chain_start", "filled",
    "bucket",
]


def engine_trace(lengths_by_step, accepts=None, depth=3, phases=None, extra_rows=None):
    """Schema-v1 step objects from per-step own lengths {seq: own_len} (what an engine
    would log). accepts[t][seq] = (drafted, accepted) when given; committed = accepted + 1."""
    steps, cum, row_steps = [], 0, 0
    for t, lens in enumerate(lengths_by_step):
        width = max(lens.values(), default=0)
        rows = []
        for i, (seq, n) in enumerate(sorted(lens.items())):
            d, a = accepts[t][seq] if accepts else (depth, 0)
            rows.append(
                {
                    "seq": seq,
                    "row": i,
                    "own_len": n,
                    "width": width,
                    "lead": width - n,
                    "u": 1,
                    "drafted": d,
                    "accepted": a,
                    "committed": a + 1,
                    "group": [1, 0],
                    "chain_start": n - 1,
                    "filled": n - 1,
                    "bucket": [0, 0, 0, 1],
                }
            )
            rows[-1].update((extra_rows or {}).get(seq, {}))
        committed = sum(r["committed"] for r in rows)
        cum += committed
        row_steps += len(rows)
        steps.append(
            {
                "type": "step",
                "step": t,
                "phase": (phases or {}).get(t, "decode"),
                "advance": "per-sequence",
                "cache_instruction": "In",
                "running": len(rows),
                "waiting": 0,
                "buckets": 1,
                "groups": 1,
                "width": width,
                "padding_fraction": sum(r["lead"] for r in rows) / (len(rows) * width)
                if rows and width
                else 0.0,
                "committed": committed,
                "tok_per_step": cum / row_steps if row_steps else 0.0,
                "rows": rows,
            }
        )
    return steps


def write_jsonl(steps, path, header=True, summary=None):
    lines = []
    if header:
        lines.append(
            {
                "type": "header",
                "schema": "raggedspec-trace",
                "version": 1,
                "mode": "lengths",
                "scenario": {},
            }
        )
    lines += steps
    if summary:
        lines.append({"type": "summary"} | summary)
    Path(path).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def write_csv(steps, path):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for s in steps:
            for r in s["rows"]:
                cells = {**{k: s.get(k) for k in CSV_COLUMNS[:10]}, **r}
                g = r.get("group")
                cells["group_u"], cells["group_start"] = (g if g else (None, None))
                cells["bucket"] = ":".join(map(str, r["bucket"])) if r.get("bucket") else None
                w.writerow(["" if cells.get(k) is None else cells[k] for k in CSV_COLUMNS])
    return path


def section_17_3(k_steps, strip):
    """cache-and-draft §17.3: starts [7,4,6], per-step advance [3,1,2], n_draft 3. Stripped:
    start_i + adv_i*k. Not stripped: the row records the aligned width, live - 3 + adv_i =
    max(start) + adv_i."""
    lens = [7, 4, 6]
    adv = [3, 1, 2]
    out = []
    for _ in range(k_steps + 1):
        out.append({i: n for i, n in enumerate(lens)})
        lens = (
            [n + a for n, a in zip(lens, adv, strict=False)]
            if strip
            else [max(lens) + a for a in adv]
        )
    return out


def steps_with_accepts(pairs_per_step):
    """One row per step with (drafted, accepted)."""
    return engine_trace([{0: 10 + t} for t in range(len(pairs_per_step))],
                        accepts=[{0: pa} for pa in pairs_per_step])


def brute_spread(steps):
    """Independent oracle: per decode step, sorted spreads -> (min, median, max)."""
    out = []
    for s in steps:
        if s.get("phase", "decode") != "decode" or not s["rows"]:
            continue
        lens = [r["own_len"] for r in s["rows"]]
        sp = sorted(n - min(lens) for n in lens)
        m = len(sp)
        med = sp[m // 2] if m % 2 else (sp[m // 2 - 1] + sp[m // 2]) / 2
        out.append((s["step"], sp[0], med, sp[-1]))
    return out


def minimal_engine_lines(n_steps=10):
    """What a bare engine might log: only the required fields."""
    return [
        {"step": t, "rows": [{"seq": q, "own_len": 10 + t * (q + 1)} for q in range(3)]}
        for t in range(n_steps)
    ]


def figure_text(fig):
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()] + [t.get_text() for t in ax.texts]
        leg = ax.get_legend()
        if leg:
            out += [t.get_text() for t in leg.get_texts()]
    for leg in fig.legends:
        out += [t.get_text() for t in leg.get_texts()]
    return " | ".join(" ".join(x.split()) for x in out)  # wrapped lines joined back


def outside_the_canvas(fig) -> list[str]:
    """The texts and legends of a drawn figure that reach outside its canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    out = []
    artists = [fig._suptitle, fig._supxlabel] + list(fig.legends)
    for ax in fig.axes:
        artists += [ax.title, ax._left_title, ax._right_title, ax.get_legend(), ax.xaxis.label,
                    ax.yaxis.label]
    for a in artists:
        if a is None or not a.get_visible() or (hasattr(a, "get_text") and not a.get_text()):
            continue
        e = a.get_window_extent(renderer)
        if e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1 or e.y1 > box.y1 + 1:
            text = getattr(a, "get_text", lambda: "")()
            out.append(f"{type(a).__name__} {text!r:.40} at {e.bounds}")
    return out
