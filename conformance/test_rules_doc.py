"""docs/rules.md is the map rule -> function -> invariant, and each test names the rows it pins
with `@pytest.mark.rule(...)`. These tests keep both honest: every function the table names
exists, every rule the spec names is listed, every test carries a marker naming a row, and every
modelled row has a test. The commands' docs pages show the usage their `--help` prints."""

import pytest
import importlib
import importlib.util
import re
import sys
from pathlib import Path

from raggedspec.conformance.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "docs" / "rules.md"
SPEC_NAMES = ROOT / "docs" / "spec-rules.txt"
SPEC_DIR = ROOT.parent / "shared" / "spec"


def table_rows():
    from raggedspec.conformance.runner import table_rows as rows

    return rows(RULES.read_text())


SCRIPTS = ROOT / "scripts"
_SCRIPT_MODULES: dict[Path, object] = {}


def resolve_script(parts: list[str]):
    """`scripts.x.f`: `f` of the checkout's scripts/x.py (not a package, so loaded from its
    file); None where there is no scripts/ folder (an installed raggedspec has none)."""
    if not SCRIPTS.is_dir():
        return None
    path = SCRIPTS / f"{parts[1]}.py"
    if not path.is_file():
        raise ModuleNotFoundError(f"no script {path.relative_to(ROOT)}")
    if path not in _SCRIPT_MODULES:
        spec = importlib.util.spec_from_file_location(f"rules_doc_scripts_{parts[1]}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        sys.path.insert(0, str(SCRIPTS))  # a script imports its siblings by their bare names
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(SCRIPTS))
        _SCRIPT_MODULES[path] = module
    obj = _SCRIPT_MODULES[path]
    for attr in parts[2:]:
        obj = getattr(obj, attr)
    return obj


def resolve(dotted: str):
    """`reference.dispatch.f` (the table names functions by folder; the tools beside the CLI as
    `raggedspec.x`, the checkout's scripts as `scripts.x`) under the import name."""
    parts = dotted.split(".")
    if parts[0] == "scripts" and len(parts) > 1:
        return resolve_script(parts)
    if parts[0] != "raggedspec":  # the rules' folders, under the import name
        parts = ["raggedspec", *parts]
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_the_table_is_not_degenerate():
    rows = table_rows()
    assert len(rows) >= 60, f"docs/rules.md has only {len(rows)} rule rows"


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_every_listed_function_exists():
    missing = []
    for rule, function, _inv in table_rows():
        if function.lower().startswith("not modelled"):
            continue
        for name in re.findall(r"`?([A-Za-z_][\w.]*)`?", function):
            try:
                resolve(name)
            except (ModuleNotFoundError, AttributeError) as exc:
                missing.append(f"{rule}: {name} ({exc})")
    assert not missing, "\n".join(missing)


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_every_test_carries_a_rule_that_names_a_row(request):
    """Each collected test names the docs/rules.md rows it pins (`@pytest.mark.rule`); a name
    that is no row's is reported with the test, and so is a test without a marker."""
    from raggedspec.conformance.runner import RULE_MARKS
    from raggedspec.conformance.runner import rule_names

    marks = request.config.stash[RULE_MARKS]
    known = set(rule_names(RULES.read_text()))
    assert request.node.nodeid in marks and len(known) >= 60
    bad = [f"{nodeid}: {names or 'no rule marker'}" for nodeid, names in marks.items()
           if not names or set(names) - known]
    assert not bad, "tests whose rule marker names no row of docs/rules.md:\n" + "\n".join(bad)


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_every_modelled_rule_has_a_test(request):
    """Every row that is modelled has at least one test carrying its marker (checked in a
    session that collected the whole folder; conftest deselects it elsewhere)."""
    from raggedspec.conformance.runner import RULE_MARKS
    from raggedspec.conformance.runner import rule_names

    pinned = {n for names in request.config.stash[RULE_MARKS].values() for n in names}
    untested = [r for r in rule_names(RULES.read_text()) if r not in pinned]
    assert not untested, f"rows of docs/rules.md no test carries: {untested}"


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_marker_names_drop_backticks_and_the_trailing_spec_reference():
    from raggedspec.conformance.runner import marker_name

    assert marker_name("`front_pad_single` (C §4.1, M §14)") == "front_pad_single"
    assert marker_name("`raggedspec bench` (tooling)") == "raggedspec bench"
    assert marker_name("SingleCache::append (C §3, §18)") == "SingleCache::append"
    assert marker_name("a (b) c") == "a (b) c"


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_unmodelled_rules_say_why():
    for rule, function, invariant in table_rows():
        if function.lower().startswith("not modelled"):
            assert len(invariant) > 15, f"{rule} is not modelled and gives no reason"


def spec_names() -> list[str]:
    return [
        line.strip()
        for line in SPEC_NAMES.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_every_rule_the_spec_names_is_listed():
    listed = " ".join(r[0] for r in table_rows())
    absent = [n for n in spec_names() if n not in listed]
    assert not absent, f"rules named in the spec but absent from docs/rules.md: {absent}"


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_the_name_list_covers_the_spec_headings():
    """When the spec sits beside the checkout (as in CI and development), every
    backticked name in a section heading must be in docs/spec-rules.txt."""
    names = set(spec_names())
    heading_names = set()
    found_spec = SPEC_DIR.is_dir()
    sources = sorted(SPEC_DIR.glob("*.md")) if found_spec else []
    for path in sources:
        for line in path.read_text().splitlines():
            if re.match(r"^#{2,4} \d", line):
                heading_names.update(re.findall(r"`([A-Za-z_][\w:]*)", line))
    ignored = {
        "step",
        "tests",
        "describes",
        "the_draft_dead_prefix_does_not_survive_into_the_per_sequence_caches",
        "NormalCacheManager::clone_in_cache",
        "Attention::apply_rope_inplace",
    }
    assert heading_names - names - ignored == set()
    assert found_spec or names, "neither the spec nor the vendored name list is available"


# cache-and-draft §17.2, every test of the table, with the spec's shorthand expanded
# ("`verify_proposed_lossless_contract` / `_all_accepted`" -> verify_proposed_all_accepted;
# "`try_wrap_…_depth_zero_is_noop`" -> try_wrap_pipeline_with_mtp_depth_zero_is_noop).
SECTION_17_2_TESTS = [
    "mtp_decode_kit_step_shape",
    "mtp_tail_is_floored_at_int8",
    "argmax_token_picks_max",
    "propose_chain_returns_depth_tokens",
    "propose_chain_respects_max_tokens_cap",
    "acceptance_counters_increment",
    "acceptance_rate_moves_to_one_on_all_accept_and_zero_on_all_reject",
    "per_position_acceptance_separates_profiles_the_aggregate_cannot",
    "per_position_acceptance_is_on_the_marker_and_the_report",
    "positions_beyond_the_cap_are_flagged_not_hidden",
    "skipped_draft_steps_count_as_steps_and_pull_the_multiplier_to_one",
    "acceptance_logging_is_on_unless_explicitly_disabled",
    "acceptance_report_fires_once_per_log_period",
    "acceptance_report_states_the_counted_ratio",
    "acceptance_logger_fires_from_the_record_path_only_when_gated_on",
    "verify_proposed_lossless_contract",
    "verify_proposed_all_accepted",
    "verify_proposed_immediate_rejection",
    "cache_truncation_restores_decode_invariant",
    "cache_truncation_rejection_off_by_one_pinned",
    "argmax_logits_per_row_extracts_tail_rows",
    "argmax_logits_per_row_handles_batch_dim",
    "speculative_mtp_v4_verify_accepts_at_least_40pct",
    "speculative_mtp_v4_propose_verify_loop_is_consistent",
    "a_temperature_request_does_not_take_the_mtp_path",
    "a_sequence_that_may_not_draft_is_in_no_draft_group",
    "a_non_drafting_sequence_accounts_as_plain_decode",
    "try_wrap_pipeline_with_mtp_depth_zero_is_noop",
    "try_wrap_pipeline_with_mtp_no_kit_falls_back",
    "try_wrap_pipeline_with_mtp_engages_wrapper",
    "the_capability_probe_names_the_slot_that_cannot_carry_its_own_length",
    "the_mask_capability_passes_for_v4_and_still_refuses_for_everyone_else",
    "a_fully_capable_v4_cache_is_still_refused_and_now_names_the_scheduler",
    "the_draft_chain_capability_passes_for_v4_and_still_refuses_for_everyone_else",
    "the_draft_chain_check_is_implied_by_the_mask_check_today",
    "a_uniform_batch_never_reaches_the_per_row_step_arithmetic",
    "the_per_row_step_arithmetic_is_opt_in",
    "a_batch_that_is_not_a_left_aligned_cohort_is_refused_by_name",
    "per_row_lengths_are_what_keep_a_ragged_cohorts_tails_inside_the_window",
    "the_window_invariant_is_what_keeps_the_verify_slice_in_range",
    "the_draft_group_partition_stops_collapsing_once_the_rows_carry_their_own_positions",
    "a_uniform_draft_group_never_reaches_the_ragged_chain_path",
    "the_draft_leads_are_the_distance_to_the_groups_widest_row",
    "the_capture_offsets_collapse_when_the_rows_agree_and_survive_when_they_do_not",
    "the_group_key_and_the_per_row_chain_start_are_the_same_expression",
    "the_window_invariant_is_unchanged_for_a_uniform_batch",
    "both_plans_agree_on_what_each_sequence_can_vouch_for",
    "per_sequence_advance_never_lets_a_tail_ratchet_at_b128",
    "per_sequence_advance_is_token_identical_to_the_b1_reference",
    "the_two_advance_rules_are_identical_at_batch_one",
    "per_sequence_plan_ignores_every_other_sequence",
    "tok_per_step_at_b128_is_bounded_by_the_cohort_rule_and_freed_by_the_per_sequence_rule",
    "batched_window_invariant_closes_at_every_depth_and_accept_pattern",
    "batched_ragged_accept_is_token_identical_to_the_b1_reference",
    "batched_rollback_mutation_max_instead_of_min_is_caught",
    "window_verify_row_off_by_one_destroys_acceptance",
    "batched_acceptance_is_reported_per_batch_size",
    "plan_batch_step_keeps_only_what_every_sequence_can_prove",
    "a_ragged_draft_group_is_left_aligned_where_the_old_path_refused_it",
    "the_draft_dead_prefix_does_not_survive_into_the_per_sequence_caches",
    "a_uniform_draft_group_round_trips_through_the_batched_cache_unchanged",
    "front_align_draft_group_refuses_a_mismatched_or_over_long_group",
    "the_draft_step_end_column_is_the_batch_maximum_and_refuses_every_other_layout",
    "ragged_row_q0_is_opt_in",
    "mtp_verify_rollback_restores_the_compressor_rows_exactly",
    "mtp_depth_cap_stays_within_the_retained_rollback_margin",
]


def spec_17_2_names() -> list[str] | None:
    """The backticked names of the §17.2 table's first column, as the spec writes them
    (shorthand included), or None when the spec does not sit beside the checkout."""
    path = SPEC_DIR / "cache-and-draft.md"
    if not path.exists():
        return None
    text = path.read_text()
    section = text[text.index("### 17.2"):text.index("### 17.3")]
    names = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| test") and not line.startswith("|-"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


@pytest.mark.rule("docs/rules.md, the map rule -> function -> test")
def test_every_section_17_2_test_is_mapped_to_a_row(request):
    """Each §17.2 test is a test of the suite of the same name or is named in docs/rules.md,
    and the vendored list still matches the spec's table."""
    from raggedspec.conformance.runner import RULE_MARKS

    text = RULES.read_text()
    ours = {n.split("::")[-1].split("[")[0].removeprefix("test_")
            for n in request.config.stash[RULE_MARKS]}
    assert len(SECTION_17_2_TESTS) == 66
    absent = [n for n in SECTION_17_2_TESTS if n not in text and n not in ours]
    assert not absent, f"§17.2 tests with no row in docs/rules.md: {absent}"
    raw = spec_17_2_names()
    if raw is None:
        return
    unmatched = []
    for name in raw:
        if "…" in name:
            pre, post = name.split("…")
            hits = [n for n in SECTION_17_2_TESTS if n.startswith(pre) and n.endswith(post)]
        elif name.startswith("_"):
            hits = [n for n in SECTION_17_2_TESTS if n.endswith(name)]
        else:
            hits = [name] if name in SECTION_17_2_TESTS else []
        if len(hits) != 1:
            unmatched.append(name)
    assert not unmatched and len(raw) == len(SECTION_17_2_TESTS), f"§17.2 changed: {unmatched}"


COMMAND_DOCS = [
    pytest.param("check-kernel", "kernels.md", marks=pytest.mark.rule("raggedspec check-kernel"),
                 id="check-kernel"),
    pytest.param("check-trace", "trace-check.md", marks=pytest.mark.rule("raggedspec check-trace"),
                 id="check-trace"),
]


@pytest.mark.parametrize("command, page", COMMAND_DOCS)
def test_the_usage_in_a_commands_docs_is_what_help_prints(monkeypatch, command, page):
    monkeypatch.setenv("COLUMNS", "100")
    doc = (Path(__file__).parent.parent / "docs" / page).read_text()
    shown = doc.split("## Usage\n")[1].split("```\n")[1]
    code, out, _ = run_cli(command, "--help")
    assert code == 0 and " ".join(out.split("Exit codes:")[0].split()) == " ".join(shown.split())


@pytest.mark.parametrize("command, page", COMMAND_DOCS)
def test_the_command_list_shows_a_command_alike_when_its_parser_is_built(command, page):
    """`raggedspec --help COMMAND` builds that command's parser, `raggedspec --help` only
    lists the commands: both list the command with the same line."""
    plain, built = run_cli("--help"), run_cli("--help", command)
    assert plain[0] == built[0] == 0 and built[1] == plain[1]
