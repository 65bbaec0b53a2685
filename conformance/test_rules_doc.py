"""docs/rules.md is the map rule -> function -> test. These tests keep it honest: every
function and test it names exists, and every rule the spec names is listed."""

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "docs" / "rules.md"
SPEC_NAMES = ROOT / "docs" / "spec-rules.txt"
SPEC_DIR = ROOT.parent / "shared" / "spec"


def table_rows():
    rows = []
    for line in RULES.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and line.startswith("|") and not set(cells[0]) <= set("-: ") and cells[0] != "rule":
            rows.append(cells)
    return rows


def resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def test_the_table_is_not_degenerate():
    rows = table_rows()
    assert len(rows) >= 60, f"docs/rules.md has only {len(rows)} rule rows"


def test_every_listed_function_exists():
    missing = []
    for rule, function, _tests, _inv in table_rows():
        if function.lower().startswith("not modelled"):
            continue
        for name in re.findall(r"`?([A-Za-z_][\w.]*)`?", function):
            try:
                resolve(name)
            except (ModuleNotFoundError, AttributeError) as exc:
                missing.append(f"{rule}: {name} ({exc})")
    assert not missing, "\n".join(missing)


def test_every_listed_test_exists():
    missing = []
    cache: dict[Path, set[str]] = {}
    for rule, function, tests, _inv in table_rows():
        if function.lower().startswith("not modelled"):
            continue
        refs = re.findall(r"(conformance/[\w/]+\.py)::([\w:]+)", tests)
        if not refs:
            missing.append(f"{rule}: no test named")
        for file, name in refs:
            path = ROOT / file
            if not path.exists():
                missing.append(f"{rule}: {file} does not exist")
                continue
            if path not in cache:
                cache[path] = defined_tests(path)
            names = cache[path]
            if name.split("::")[-1] not in names:
                missing.append(f"{rule}: {file}::{name} does not exist")
    assert not missing, "\n".join(missing)


def test_unmodelled_rules_say_why():
    for rule, function, _tests, invariant in table_rows():
        if function.lower().startswith("not modelled"):
            assert len(invariant) > 15, f"{rule} is not modelled and gives no reason"


def spec_names() -> list[str]:
    return [l.strip() for l in SPEC_NAMES.read_text().splitlines() if l.strip() and not l.startswith("#")]


def test_every_rule_the_spec_names_is_listed():
    listed = " ".join(r[0] for r in table_rows())
    absent = [n for n in spec_names() if n not in listed]
    assert not absent, f"rules named in the spec but absent from docs/rules.md: {absent}"


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
    ignored = {"step", "tests", "describes", "the_draft_dead_prefix_does_not_survive_into_the_per_sequence_caches",
               "NormalCacheManager::clone_in_cache", "Attention::apply_rope_inplace"}
    assert heading_names - names - ignored == set()
    assert found_spec or names, "neither the spec nor the vendored name list is available"
