#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel, check their metadata, install
# the wheel (with its test extra) in a fresh virtual environment, and run the commands a user
# runs from a folder outside the checkout. Exit 0 only if every step passes.
#
#   bash scripts/check_wheel.sh            # CI runs this (.ci/run)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/raggedspec-wheel-XXXXXX")
trap 'rm -rf "$work"' EXIT
step() { printf '\n== %s\n' "$*"; }

step "build the sdist and the wheel"
python -m build --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
ls "$work/dist"
python -m twine check --strict "$work"/dist/*

step "install the wheel in a fresh venv"
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0          # the CPU build from local disk, before the extra's range
wheel=$(ls "$work"/dist/*.whl)
"$py" -m pip install -q "${wheel}[test]"
cd "$work"                                      # nothing of the checkout on the path from here on
rs="$work/venv/bin/raggedspec"

step "raggedspec --version"
"$rs" --version | tee version.txt
grep -qx "raggedspec $("$py" -c 'import importlib.metadata as m; print(m.version("raggedspec"))')" version.txt

step "raggedspec drift --out drift"
"$rs" drift --out drift --quiet
for f in summary.json; do test -s "drift/$f" || { echo "missing drift/$f"; exit 1; }; done
ls drift | grep -q '\.png$' || { echo "drift wrote no figure"; exit 1; }

step "raggedspec conformance -k rope"
"$rs" conformance -k rope | tee conformance.txt
if grep -q "(no rule marker)" conformance.txt; then
    echo "tests without a rule marker: every test names its docs/rules.md row(s) with"
    echo "@pytest.mark.rule (conformance/test_rules_doc.py lists them)"
    exit 1
fi
grep -qE "^[0-9]+ rows: [0-9]+ pass, 0 FAIL" conformance.txt

step "raggedspec mutation --catalogue-only --only draft_group_key"
"$rs" mutation --catalogue-only --only draft_group_key | tee mutation.txt
grep -q "mutation gate: PASS" mutation.txt

step "raggedspec simulate --example per-sequence-b128"
"$rs" simulate --example per-sequence-b128 --out trace.jsonl --quiet
test -s trace.jsonl
step "wheel check: PASS"
