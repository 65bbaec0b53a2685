"""The end-to-end part of `raggedspec bench` (`--e2e`): the simulator run under cohort and
per-sequence advance with the same scenario, timed per step, written as e2e.json and e2e.md.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from raggedspec.bench.report import render_e2e
from raggedspec.bench.timing import SCHEMA, machine_info, write_json

# End-to-end (--e2e): the scenario keys given to the simulator. A uniform prompt, so every
# request is prefilled in the first step and the batch runs all B rows from then on; under
# per-sequence advance the rows' own lengths then drift apart, under cohort they do not.
E2E_FULL = dict(
    device="cuda",
    dtype="float32",
    batch=128,
    prompt=1024,
    steps=24,
    depth=3,
    acceptance="profile:0.74,0.54,0.41",
    max_seq_len=4096,
    model={
        "vocab": 1024,
        "hidden": 1024,
        "n_heads": 8,
        "head_dim": 128,
        "rope_dims": 64,
        "sliding_window": 128,
        "compress_ratios": [0, 4],
    },
)
E2E_SMOKE = dict(device="cpu", dtype="float64", batch=8, prompt=32, steps=6, depth=3,
                 acceptance="profile:0.74,0.54,0.41", max_seq_len=4096, model={})


def e2e_settings(args) -> dict:
    cfg = dict(E2E_SMOKE if args.smoke else E2E_FULL)
    cfg["model"] = dict(cfg["model"])
    for flag, key in (
        ("device", "device"),
        ("dtype", "dtype"),
        ("e2e_batch", "batch"),
        ("e2e_prompt", "prompt"),
        ("e2e_steps", "steps"),
    ):
        value = getattr(args, flag)
        if value is not None:
            cfg[key] = value
    if cfg["dtype"] not in ("float64", "float32", "bfloat16"):
        raise ValueError(
            f"--e2e runs the torch backend in float64, float32 or bfloat16, not {cfg['dtype']}"
        )
    if min(cfg["batch"], cfg["prompt"], cfg["steps"]) < 1:
        raise ValueError("--e2e-batch, --e2e-prompt and --e2e-steps must be >= 1")
    cfg.update(smoke=bool(args.smoke), seed=args.seed, backend=args.e2e_backend)
    return cfg


def e2e_overrides(cfg: dict, advance: str) -> list[str]:
    """The scenario (load_scenario overrides) of one e2e run."""
    out = [
        f"batch={cfg['batch']}",
        f"prompt_len={cfg['prompt']}",
        "max_new_tokens=1000000",
        f"steps={cfg['steps']}",
        f"depth={cfg['depth']}",
        f"max_seq_len={cfg['max_seq_len']}",
        f"seed={cfg['seed']}",
        f"acceptance={json.dumps(cfg['acceptance'])}",
        f"advance={json.dumps(advance)}",
    ]
    if advance == "per-sequence":
        out += ['world="WB"', 'admission="grant"', "xs_per_seq=true"]
    out += [f"model.{k}={json.dumps(v)}" for k, v in cfg["model"].items()]
    return out


def run_e2e(cfg: dict, out_dir: Path, log=None) -> dict:
    """Cohort and per-sequence advance through `reference.simulator.run` on the backend
    `cfg["backend"]` (default torch: `raggedspec.gpu.backend.TorchBackend(device, dtype)`;
    "cupy": the kernels); each step's wall time from the simulator's progress callback (the
    device synchronized first), its live KV tokens (sum of the rows' own lengths) and padded
    tokens (rows x batch width) from the trace. Writes e2e.json and
    e2e.md under out_dir; returns the result."""
    import torch

    from raggedspec.reference import simulator
    from raggedspec.reference.backend import load_backend
    from raggedspec.reference.scenario import load_scenario

    log = log or (lambda msg: None)
    device = torch.device(cfg["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch.cuda.is_available() is False")
    load_backend(
        cfg.get("backend", "torch"), cfg["device"], cfg["dtype"]
    )  # a backend that cannot run: exit 2 now
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "schema": SCHEMA + "/e2e",
        "smoke": cfg["smoke"],
        "settings": cfg,
        "machine": machine_info(device),
        "runs": [],
    }
    for advance in ("cohort", "per-sequence"):
        sc = load_scenario(None, e2e_overrides(cfg, advance))
        backend = load_backend(cfg.get("backend", "torch"), cfg["device"], cfg["dtype"])
        stamps = []

        def progress(done, total, stamps=stamps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())

        t0 = time.perf_counter()
        try:
            trace = simulator.run(sc, progress=progress, backend=backend)
        except Exception as exc:  # noqa: BLE001 - reported, the other run still goes
            result["runs"].append(
                {"advance": advance, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            )
            log(f"e2e {advance}: failed: {result['runs'][-1]['error']}")
            continue
        wall = [(b - a) * 1e3 for a, b in zip([t0] + stamps, stamps, strict=False)]
        steps = []
        for st, ms in zip(trace.steps(), wall, strict=False):
            rows = st["rows"]
            steps.append(
                {
                    "step": st["step"],
                    "phase": st["phase"],
                    "running": st["running"],
                    "width": st["width"],
                    "live_tokens": sum(r["own_len"] for r in rows),
                    "padded_tokens": len(rows) * st["width"],
                    "committed": st["committed"],
                    "ms": ms,
                    "error": st.get("error"),
                }
            )
        # steady state: decode steps after the first two (warm-up, allocator growth)
        dec = [x for x in steps if x["phase"] == "decode"][2:]
        run = {"advance": advance, "steps": steps, "summary": trace.summary}
        if dec:
            run.update(decode_steps=len(dec), median_ms=statistics.median(x["ms"] for x in dec),
                       mean_live_tokens=statistics.mean(x["live_tokens"] for x in dec),
                       mean_padded_tokens=statistics.mean(x["padded_tokens"] for x in dec),
                       committed_per_step=statistics.mean(x["committed"] for x in dec),
                       max_rows=max(x["running"] for x in dec))
            run["ms_per_committed_token"] = run["median_ms"] / max(run["committed_per_step"], 1e-9)
        result["runs"].append(run)
        log(
            f"e2e {advance}: {len(steps)} steps, decode median "
            f"{run.get('median_ms', float('nan')):.2f} ms"
        )
        write_json(result, out_dir / "e2e.partial.json")  # a run cut short keeps its runs
    write_json(result, out_dir / "e2e.json")
    (out_dir / "e2e.partial.json").unlink(missing_ok=True)
    from raggedspec.outputs import write_text_atomic

    write_text_atomic(out_dir / "e2e.md", render_e2e(result))
    return result
