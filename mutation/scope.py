"""What mutmut mutates, what it leaves out and why, and which tests each module's mutants run.

`MUTMUT_MODULES` names every rule module of `reference/` and `gpu/` with the test files that
cover it: mutmut runs once per module, with only those files as its test selection, so a
module's mutants never run the whole suite. `EXCLUDED` names everything else under those two
folders (and the project's other code) with the reason it is not mutated. The two tables are
the one source of truth: `conformance/test_mutation_shards.py` fails when a file under
`reference/` or `gpu/` is in neither or in both, or when a listed test file does not import
the module it is listed for. docs/mutation.md shows the same tables.
"""

from __future__ import annotations

from pathlib import Path

# module -> the test files its mutants run (most specific first). Each file imports the module
# directly, or (torch backend, draft loop) runs it through the default torch backend of
# conformance/backends.py.
MUTMUT_MODULES: dict[str, tuple[str, ...]] = {
    "reference/acceptance.py": ("conformance/test_acceptance.py", "conformance/test_scenario.py"),
    "reference/accounting.py": ("conformance/test_accounting.py",),
    "reference/align.py": ("conformance/test_align.py", "conformance/test_align_draft.py",
                           "conformance/test_align_checks.py"),
    "reference/attention.py": ("conformance/test_attention.py",
                               "conformance/test_attention_inputs.py"),
    "reference/backend.py": ("conformance/test_backend.py",
                             "conformance/test_backend_protocol.py",
                             "conformance/test_backend_views.py"),
    "reference/cache.py": ("conformance/test_cache.py", "conformance/test_small_rules.py"),
    "reference/capability.py": ("conformance/test_capability.py",),
    "reference/dispatch.py": ("conformance/test_dispatch.py", "conformance/test_draft.py",
                              "conformance/test_mutation_kills.py"),
    "reference/draft.py": ("conformance/test_draft.py", "conformance/test_draft_loop.py",
                           "conformance/test_draft_checks.py"),
    "reference/errors.py": ("conformance/test_cache.py",),
    "reference/lengths.py": ("conformance/test_lengths_grid.py", "conformance/test_lengths.py",
                             "conformance/test_lengths_engine.py"),
    "reference/lengths_draft.py": ("conformance/test_lengths_draft.py",
                                   "conformance/test_lengths.py"),
    "reference/lengths_scheduler.py": ("conformance/test_lengths_scheduler.py",
                                       "conformance/test_lengths.py"),
    "reference/masks.py": ("conformance/test_masks.py",),
    "reference/model.py": ("conformance/test_model.py", "conformance/test_model_layer.py"),
    "reference/pipeline.py": ("conformance/test_spec_gaps.py",),
    "reference/policy.py": ("conformance/test_simulator.py", "conformance/test_lengths.py"),
    "reference/rope.py": ("conformance/test_rope.py",),
    "reference/scenario.py": ("conformance/test_scenario_keys.py", "conformance/test_scenario.py"),
    "reference/scheduler.py": ("conformance/test_scheduler.py",
                               "conformance/test_scheduler_admission.py",
                               "conformance/test_scheduler_state.py"),
    "reference/scheduler_telemetry.py": ("conformance/test_scheduler_telemetry.py",),
    "reference/simulator.py": ("conformance/test_simulator.py",
                               "conformance/test_simulator_draft_map.py",
                               "conformance/test_lengths_grid.py",
                               "conformance/test_simulator_log.py",
                               "conformance/test_simulator_steps.py"),
    "reference/step.py": ("conformance/test_step.py", "conformance/test_step_commit.py",
                          "conformance/test_mutation_kills.py"),
    "reference/trace.py": ("conformance/test_trace.py", "conformance/test_trace_reader.py",
                           "conformance/test_check_trace.py"),
    "reference/trace_reader.py": ("conformance/test_trace_reader_fields.py",
                                  "conformance/test_trace_reader.py"),
    "reference/xs_rolling.py": ("conformance/test_xs_rolling.py",
                                "conformance/test_xs_rolling_edges.py"),
    "gpu/align.py": ("conformance/test_port_align.py",),
    "gpu/attention.py": ("conformance/test_port_attention.py",),
    "gpu/backend.py": ("conformance/test_backend.py", "conformance/test_backend_torch.py",
                       "conformance/test_backend_torch_rows.py",
                       "conformance/test_backend_torch_protocol.py",
                       "conformance/test_backend_torch_forward.py"),
    "gpu/cache.py": ("conformance/test_port_ragged_kv.py", "conformance/test_port_cache.py"),
    "gpu/dispatch.py": ("conformance/test_port_dispatch.py", "conformance/test_port_malformed.py"),
    "gpu/draft.py": ("conformance/test_port_draft.py", "conformance/test_port_draft_refusals.py"),
    "gpu/draft_loop.py": ("conformance/test_backend.py", "conformance/test_backend_torch.py",
                          "conformance/test_draft_loop_torch.py",
                          "conformance/test_draft_extension_torch.py"),
    "gpu/draft_store.py": ("conformance/test_port_draft_store.py", "conformance/test_backend.py"),
    "gpu/layouts.py": ("conformance/test_layouts.py",),
    "gpu/masks.py": ("conformance/test_port_masks.py",),
    "gpu/model.py": ("conformance/test_port_model_rules.py", "conformance/test_port_model.py",
                     "conformance/test_port_model_branches.py"),
    "gpu/paged.py": ("conformance/test_paged_store.py", "conformance/test_paged.py"),
    "gpu/paged_backend.py": ("conformance/test_paged_backend_slots.py",
                             "conformance/test_paged.py"),
    "gpu/rope.py": ("conformance/test_port_rope.py",),
    "gpu/slots.py": ("conformance/test_port_slots.py", "conformance/test_port_cache.py",
                     "conformance/test_port_slots_edges.py"),
    "gpu/xs_rolling.py": ("conformance/test_port_xs_rolling.py",
                          "conformance/test_port_xs_rolling_slot.py",
                          "conformance/test_port_xs_rolling_append.py"),
}

# path (a file, or a folder ending in "/") -> why mutmut does not mutate it
EXCLUDED: dict[str, str] = {
    "reference/__init__.py": "package marker: no functions",
    "gpu/__init__.py": "package marker: no functions",
    "reference/protocol.py": "data: the backend protocol's method table and one dataclass, no "
                             "logic (test_protocol_coverage.py checks the table itself)",
    "gpu/_common.py": "device placement and dtype helpers: every tensor is on the one device of "
                      "a CPU run, so their mutants are invisible there; kept out of the mutated "
                      "code on purpose, pinned by a CUDA run of the port's conformance",
    "gpu/cupy_backend.py": "CuPy: needs a CUDA device; on the CPU its tests skip, so every "
                           "mutant would survive",
    "gpu/cupy_kernels.py": "CuPy kernel launchers: need a CUDA device (the kernels' CUDA source "
                           "is mutated by the catalogue's kernel entries under the emulator)",
    "gpu/kernel_emulator.py": "emulator: the g++ harness that runs the CUDA kernels on the CPU, "
                              "a test instrument, not a rule",
    "gpu/testing.py": "testing helpers (comparison, port conversion), not a rule",
    "raggedspec/bench/": "benchmarks: timing and reports, no rule",
    "raggedspec/cli.py": "CLI: argument parsing and output; its own tests are about text",
    "conformance/": "the tests themselves",
    "mutation/": "the mutation runner",
}

# The folders whose every .py file must be in exactly one of the two tables.
SCOPED_FOLDERS = ("reference", "gpu")


def modules_in_scope(scope: str, root: Path | None = None) -> list[str]:
    """The modules of `MUTMUT_MODULES` for a scope ("reference", "gpu" or "all"), in table
    order; with `root`, only those that exist there."""
    out = [m for m in MUTMUT_MODULES if scope == "all" or m.split("/", 1)[0] == scope]
    return [m for m in out if (root / m).is_file()] if root is not None else out


def unclassified(root: Path) -> dict[str, str]:
    """{path: problem} for .py files under `SCOPED_FOLDERS` that are in neither table or in
    both, and for table entries that name no file."""
    problems: dict[str, str] = {}
    for folder in SCOPED_FOLDERS:
        for p in sorted((root / folder).glob("*.py")):
            rel = p.relative_to(root).as_posix()
            listed = (rel in MUTMUT_MODULES) + (rel in EXCLUDED)
            if listed == 0:
                problems[rel] = "in neither MUTMUT_MODULES nor EXCLUDED"
            elif listed == 2:
                problems[rel] = "in both MUTMUT_MODULES and EXCLUDED"
    for rel in list(MUTMUT_MODULES) + list(EXCLUDED):
        if not (root / rel.rstrip("/")).exists():
            problems[rel] = "listed but not present"
    return problems
