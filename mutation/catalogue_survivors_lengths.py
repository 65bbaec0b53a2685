"""Catalogue entries for the bugs the survivors of mutmut's run on the lengths-only engine
(`reference/lengths.py`) showed the suite once missed: paths the seeded grid of small
scenarios never took (an idle step between arrivals, the compressed-cache rollback refusal,
a capacity exactly at `max_seq_len`, a prompt step's row array), what no trace line
carries (the per-batch-size telemetry, the progress callback, the file model's per-row
verify count) and `run`'s own inputs. Each entry is killed by a test of
conformance/test_lengths_engine.py, which runs the lengths engine against the tensor mode on
cases chosen for these paths. `ENTRIES` join `CATALOGUE` in `mutation.catalogue`.
"""

from __future__ import annotations

from raggedspec.mutation.mutant import M, Mutant

R_LEN = "reference/lengths.py"
ENGINE = "test_lengths_engine.py"


def _t(test: str) -> str:
    return f"conformance/{ENGINE}::{test}"


OFF_GRID = _t("test_the_lengths_engine_agrees_with_the_tensor_mode_off_the_grid")
RUN = _t("test_run_takes_a_scenario_a_table_or_a_path_and_reports_progress")

ENTRIES: list[Mutant] = [
    M(
        "LengthsEngine.run: an idle step between arrivals ends the run (`continue` -> `break`)",
        R_LEN,
        "                self._tick(t)\n                continue\n",
        "                self._tick(t)\n                break\n",
        "C§17.1",
        OFF_GRID,
    ),
    M(
        "LengthsEngine.run: the trace written as the tensor mode's",
        R_LEN,
        'trace = Trace("lengths", sc.to_dict())',
        'trace = Trace("tensor", sc.to_dict())',
        "C§17.1",
        RUN,
    ),
    M(
        "_tick: progress reports the step index, not the steps done (`t + 1` -> `t`)",
        R_LEN,
        "self.progress(t + 1, self.sc.steps)",
        "self.progress(t, self.sc.steps)",
        "C§17.1",
        RUN,
    ),
    M(
        "run: the progress callback dropped on the way to the engine",
        R_LEN,
        "return LengthsEngine(sc, progress).run()",
        "return LengthsEngine(sc).run()",
        "C§17.1",
        RUN,
    ),
    M(
        "_prompt: a prompt step's rows built as float64, not the trace's row dtype",
        R_LEN,
        "        rows = np.zeros((b, NCOL), dtype=ROW_DTYPE)\n        fill_rows(rows, seq=ids, "
        "row=np.arange(b), own_len=plen",
        "        rows = np.zeros((b, NCOL))\n        fill_rows(rows, seq=ids, "
        "row=np.arange(b), own_len=plen",
        "C§17.1",
        OFF_GRID,
    ),
    M(
        "_decode: growth to exactly max_seq_len refused (`grown > max` -> `>=`)",
        R_LEN,
        "if (need > bcap and grown > self.max)",
        "if (need > bcap and grown >= self.max)",
        "C§5.2",
        OFF_GRID,
    ),
    M(
        "_decode: the compressed-cache rollback refused only when every row is padded",
        R_LEN,
        "if n_drop > 0 and self.has_xs and (lead > 0).any():",
        "if n_drop > 0 and self.has_xs and (lead > 0).all():",
        "C§12.1",
        _t("test_a_ragged_cohort_step_the_compressed_cache_cannot_roll_back_is_refused_alike"),
    ),
    M(
        "_accept: the file model's verify count moves for rows that did not draft (`>` -> `>=`)",
        R_LEN,
        "            d = drafts > 0\n",
        "            d = drafts >= 0\n",
        "C§17.1",
        _t("test_the_file_models_verify_count_moves_only_for_rows_that_drafted"),
    ),
    M(
        "_account: the per-batch-size telemetry without its batch-step count",
        R_LEN,
        "        entry[5] += 1\n",
        "",
        "C§15",
        OFF_GRID,
    ),
]
