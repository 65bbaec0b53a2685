"""The benchmark's reports: the live-KV bound, the markdown tables, the headline, the plot,
and the end-to-end table, all rendered from the result JSON alone (so `--replot` gives the
same files as the run that wrote the JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

from raggedspec.bench.strategies import HEADLINE, LOSSY, NEGATIVE_CONTROLS

# ----------------------------------------------------------------------------- reports


def bandwidth_GBps(result: dict) -> float:
    """The copy bandwidth the bound uses: the higher of the measurements in the run."""
    return max(m["GBps"] for m in result["copy_bandwidth"])


def bound_ms(result: dict, row: dict) -> float:
    return row["live_kv_bytes"] / (bandwidth_GBps(result) * 1e9) * 1e3


def _cell(res: dict, bound: float) -> str:
    st = res["status"]
    if st in ("ok", "lossy") and "kernel_ms" in res:
        k, ms = res["kernel_ms"], res["ms"]
        return f"{k:.3f} ({k / bound:.2f}x) kernel; {ms:.3f} ({ms / bound:.2f}x) with its wrapper"
    if st in ("ok", "lossy") and "ms" in res:
        return f"{res['ms']:.3f} ({res['ms'] / bound:.2f}x)"
    if st == "WRONG":
        return f"WRONG (err {res['err']:.2g})" if "err" in res else "WRONG (precheck)"
    if st == "not run":
        return "not run"
    return "error"


def render_markdown(result: dict) -> str:
    m = result["machine"]
    s = result["settings"]
    bw = bandwidth_GBps(result)
    where = m.get("gpu") or f"CPU ({m.get('cpu')}, {m.get('cpu_count')} cores)"
    lines = []
    if result["smoke"]:
        lines.append(
            "**SMOKE run (CPU, tiny sizes, time.perf_counter): it checks that every path runs and "
            "agrees with the reference; its times are no performance claim.**"
        )
        lines.append("")
    lines += [
        f"Machine: {where}; torch {m['torch']}"
        + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
        + (f", CuPy {m['cupy']}" if m.get("cupy") else ", no CuPy")
        + f"; Python {m['python']}.",
        (
            f"Sizes: dtype {s['dtype']}, {s['kv_heads']} KV heads, {s['q_heads']} query heads, "
            "head dim "
            f"{s['head_dim']}; timer: {result['timer']}; warm-up {s['warmup']}, median of "
            f"{s['reps']}; seed {s['seed']}."
        ),
        "Copy bandwidth (device-to-device, read + write): "
        + ", ".join(f"{c['GBps']:.1f} GB/s" for c in result["copy_bandwidth"])
        + (
            f"; the bound uses {bw:.1f} GB/s. Bound = live K+V bytes / bandwidth. "
            "Cells: median ms (ms / bound); a strategy timed without its wrapper too shows its "
            "kernels alone (launched back to back) first, then the whole call. "
            "Correctness tolerance: rel. error <= "
            f"{result['tolerance']:g} "
            "against the float64 reference (WRONG: not timed)."
        ),
        "",
    ]
    names = result["strategies"]
    hdr = ["w", "B", "L", "spread", "live KV MiB", "bound ms"] + [
        n + (" (lossy)" if n in LOSSY else "") for n in names
    ]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    rows = sorted(result["rows"], key=lambda r: (r["w"], r["L"], r["spread"], r["B"]))
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | case failed: {r['error']} |"
            )
            continue
        bound = bound_ms(result, r)
        cells = [_cell(r["strategies"][n], bound) for n in names]
        lines.append(
            f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | {r['live_kv_bytes'] / 2**20:.2f} "
            "| "
            f"{bound:.4f} | " + " | ".join(cells) + " |"
        )
    lines.append("")
    lines.append("Strategies:")
    for n in names:
        extra = []
        if n in result.get("not_run", {}):
            extra.append("not run: " + result["not_run"][n])
        if n in result.get("precheck", {}).get("failed", {}):
            extra.append("WRONG in the precheck: " + result["precheck"]["failed"][n])
        if n in result.get("notes", {}):
            extra.append(result["notes"][n])
        if n in LOSSY:
            errs = [r["strategies"][n]["err_full"] for r in rows
                    if "strategies" in r and r["strategies"][n].get("status") == "lossy"]
            if errs:
                extra.append(
                    f"error against the full reference where rows differ: {min(errs):.2g} .. "
                    f"{max(errs):.2g}"
                )
        lines.append(f"- `{n}`: {result['labels'][n]}" + ("; " + "; ".join(extra) if extra else ""))
    if result.get("cases_not_run"):
        lines.append(
            "- cases not run (time budget): "
            + ", ".join(
                f"w={c['w']} B={c['B']} L={c['L']} spread={c['spread']}"
                for c in result["cases_not_run"]
            )
        )
    if not result.get("complete"):
        lines.append("- the run did not complete: the table holds the cases it finished")
    lines += headline_lines(result, rows)
    lines += [
        "",
        "Data movement per step, against the live KV (bytes counted, times measured):",
        "",
        (
            "| w | B | L | spread | live KV MiB | front-align copy MiB (x live) | front-align ms | "
            "port append KiB (x live) | append+commit ms | strip bytes | "
            "paged append KiB (copy on write) | paged rollback / strip bytes |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            continue
        live = r["live_kv_bytes"]
        lines.append(
            f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | {live / 2**20:.2f} | "
            f"{r['align_bytes'] / 2**20:.2f} ({r['align_bytes'] / live:.2f}x) | "
            f"{r['align_ms']:.3f} | "
            f"{r['append_bytes'] / 2**10:.1f} ({r['append_bytes'] / live:.2g}x) | "
            f"{r['append_ms']:.3f} | "
            f"{r['strip_bytes']} | {paged_cells(r)} |"
        )
    lines += [
        "",
        (
            "Front-align copy = the gather `gpu.align.materialize_front_aligned` does (reads and "
            "writes B x T columns of K and V); port append = the new tokens' K/V written at each "
            "row's own offset (`RaggedKv.append`, w columns per row); the per-sequence commit / "
            "dead-prefix strip moves no data in the in-place layout (lengths only); paged = the "
            "paged port's bytes counted by its page store (`raggedspec.paged_moves`, page size "
            "16)."
        ),
    ]
    return "\n".join(lines) + "\n"


def paged_cells(r: dict) -> str:
    """The paged port's counted cells (`raggedspec.paged_moves`) for a data-movement row:
    append KiB (copy on write KiB) and rollback / strip bytes; "-" for a result without them."""
    if "paged_append_bytes" not in r:
        return "- | -"
    return (f"{r['paged_append_bytes'] / 2**10:.1f} ({r['paged_cow_bytes'] / 2**10:.1f}) | "
            f"{r['paged_rollback_bytes']} / {r['paged_strip_bytes']}")


TARGET_X_BOUND, TARGET_SPEEDUP = 1.10, 30.0     # the CuPy kernel's targets at the headline case


def headline_lines(result: dict, rows: list[dict]) -> list[str]:
    """For the headline case (B=128, L=4096, spread 64), each timed strategy's ms / bound
    and speed-up over the per-row loop, and whether the CuPy kernel meets the targets (the
    bound on its kernel time alone where measured, the speed-up on the whole call)."""
    out = []
    for r in rows:
        if "strategies" not in r or (r["B"], r["L"], r["spread"]) != (
            HEADLINE["b"],
            HEADLINE["L"],
            HEADLINE["spread"],
        ):
            continue
        bound = bound_ms(result, r)
        base = r["strategies"].get("per_row", {}).get("ms")
        parts = [headline_part(n, res, bound, base) for n, res in r["strategies"].items()
                 if "ms" in res]
        cupy = r["strategies"].get("cupy", {})
        if "emulation" in result.get("notes", {}).get("cupy", ""):
            verdict = "targets not assessed (the cupy column is the g++ emulator on the CPU)"
        elif "ms" in cupy and base:
            kernel = cupy.get("kernel_ms", cupy["ms"])
            ok = kernel / bound <= TARGET_X_BOUND and base / cupy["ms"] >= TARGET_SPEEDUP
            verdict = "targets MET" if ok else "targets MISSED"
        else:
            verdict = f"targets not assessed (cupy: {cupy.get('status', 'absent')})"
        out.append(
            f"- headline w={r['w']} (B=128, L=4096, spread 64; bound {bound:.3f} ms): "
            + "; ".join(parts)
            + f". CuPy targets (<= {TARGET_X_BOUND:.2f}x bound and >= {TARGET_SPEEDUP:.0f}x the "
            f"per-row loop): {verdict}."
        )
    return out


def headline_part(name: str, res: dict, bound: float, base: float | None) -> str:
    """One strategy's part of a headline line: ms and x bound (the kernel alone first, with
    the whole call and the wrapper's overhead beside it, where the kernel was timed alone),
    and the speed-up over the per-row loop's call."""
    speed = f", {base / res['ms']:.1f}x the per-row loop's speed" if base else ""
    if "kernel_ms" not in res:
        return f"`{name}` {res['ms']:.3f} ms = {res['ms'] / bound:.2f}x bound{speed}"
    k = res["kernel_ms"]
    return (f"`{name}` kernel {k:.3f} ms = {k / bound:.2f}x bound (the call with its wrapper "
            f"{res['ms']:.3f} ms = {res['ms'] / bound:.2f}x, wrapper overhead "
            f"{res['ms'] - k:.3f} ms){speed}")


def render_plot(result: dict, path: Path) -> Path | None:
    """ms vs B per strategy (log-log), one panel per (w, L, spread), the live-KV bound dashed."""
    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["w"], r["L"], r["spread"]) for r in rows})
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    for ax, (w, L, spread) in zip(axes.flat, panels, strict=False):
        sel = sorted(
            (r for r in rows if (r["w"], r["L"], r["spread"]) == (w, L, spread)),
            key=lambda r: r["B"],
        )
        bs = [r["B"] for r in sel]
        ax.plot(bs, [bound_ms(result, r) for r in sel], "k--", lw=2, label="live-KV bound")
        for n in result["strategies"]:
            pts = [
                (r["B"], r["strategies"][n]["ms"])
                for r in sel
                if "ms" in r["strategies"].get(n, {})
            ]
            if pts:
                ax.plot(
                    *zip(*pts, strict=False),
                    "o-",
                    ms=3,
                    label=n + (" (lossy)" if n in LOSSY else ""),
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"w={w} L={L} spread={spread}", fontsize=9)
        ax.set_xlabel("B")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    where = result["machine"].get("gpu") or "CPU"
    fig.suptitle(
        ("SMOKE (no claims): " if result["smoke"] else "") + f"ragged verify attention, {where}, "
        f"{result['settings']['dtype']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(labels) > 4), 1, 0.96))
    from raggedspec.outputs import staged

    with staged() as stage:
        fig.savefig(stage[path], format="png", dpi=110)
    plt.close(fig)
    return path


def write_reports(result: dict, out_dir: Path) -> list[Path]:
    from raggedspec.outputs import write_text_atomic

    md = write_text_atomic(out_dir / "bench.md", render_markdown(result))
    written = [out_dir / "bench.json", md]
    png = render_plot(result, out_dir / "bench.png")
    if png:
        written.append(png)
    return written


def wrong_strategies(result: dict) -> list[str]:
    """Strategies (negative controls excepted) that came out WRONG anywhere."""
    bad = set(result.get("precheck", {}).get("failed", {}))
    for r in result["rows"]:
        for n, res in r.get("strategies", {}).items():
            if res.get("status") == "WRONG":
                bad.add(n)
    return sorted(n for n in bad if n not in NEGATIVE_CONTROLS)


def render_e2e(result: dict) -> str:
    c, m = result["settings"], result["machine"]
    where = m.get("gpu") or f"CPU ({m.get('cpu')}, {m.get('cpu_count')} cores)"
    lines = []
    if result["smoke"]:
        lines += [
            "**SMOKE run (CPU, tiny model): it checks that the path runs; no performance claim.**",
            "",
        ]
    model = json.dumps(c["model"]) if c["model"] else "default tiny"
    lines += [
        (
            f"End-to-end step time, tensor-mode simulator on the {c.get('backend', 'torch')} "
            "backend "
            f"({c['device']}, {c['dtype']}); "
            f"{where}; torch {m['torch']}. B = {c['batch']} requests of prompt {c['prompt']}, "
            f"depth {c['depth']}, "
            f"acceptance {c['acceptance']}, {c['steps']} steps, model {model}. "
            "Step time = wall time between the simulator's per-step callbacks (device "
            "synchronized); "
            "steady state = decode steps after the first two."
        ),
        "",
        (
            "| advance | decode steps | max rows | median step ms | mean live KV tokens | mean "
            "padded tokens "
            "(rows x width) | live / padded | committed / step | ms per committed token |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['advance']} | failed: {r['error']} |")
        elif "median_ms" not in r:
            lines.append(
                f"| {r['advance']} | no steady-state decode step in {len(r['steps'])} steps |"
            )
        else:
            lines.append(
                f"| {r['advance']} | {r['decode_steps']} | {r['max_rows']} | {r['median_ms']:.2f} "
                "| "
                f"{r['mean_live_tokens']:.0f} | {r['mean_padded_tokens']:.0f} | "
                f"{r['mean_live_tokens'] / max(r['mean_padded_tokens'], 1):.3f} | "
                f"{r['committed_per_step']:.1f} | {r['ms_per_committed_token']:.3f} |"
            )
    return "\n".join(lines) + "\n"
