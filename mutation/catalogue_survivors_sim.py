"""Catalogue entries for the bugs the survivors of mutmut's runs on the simulator's tensor mode
(`reference/simulator.py`) showed the suite once missed: in the tensor log the drift tools
read (a compressed width counting the dead prefix, a ratio-1 layer recorded as compressed), in
the engine's set-up (the LRU cap or the WB-only admission dropped), and in the steps (an error
count reset, a request not stopped at max_seq_len, a bonus token past max_new_tokens, a
one-column drop not truncated, a deferral fed at the shared length). Both simulator modes and
both backends share this code, so a comparison between them cannot see these; each entry is
killed by a test that checks the engine against the rule itself (`conformance/...::test_...`).
`ENTRIES` join `CATALOGUE` in `mutation.catalogue`.
"""

from __future__ import annotations

from raggedspec.mutation.mutant import M, Mutant

R_SIM = "reference/simulator.py"
LOG, STEPS = "test_simulator_log.py", "test_simulator_steps.py"


def _t(file: str, test: str) -> str:
    return f"conformance/{file}::{test}"


ENTRIES: list[Mutant] = [
    # ------------------------------------------------------------------ simulator: the tensor log
    M(
        "_record_forward: the recorded compressed width counts the dead prefix (`-` -> `+`)",
        R_SIM,
        "t_c = max((after - lead) // ratio for lead in leads)",
        "t_c = max((after + lead) // ratio for lead in leads)",
        "C§17.1 tensor log",
        _t(LOG, "test_each_forward_and_state_record_of_the_per_sequence_example"),
    ),
    M(
        "_record_forward: a ratio-1 layer recorded as compressed (`> 1` -> `>= 1`)",
        R_SIM,
        "            if ratio > 1:  # compressed keys",
        "            if ratio >= 1:  # compressed keys",
        "C§17.1 tensor log",
        _t(LOG, "test_the_masks_follow_the_window_and_each_layers_ratio"),
    ),
    M(
        "_fail: a failed step counted as the only error so far (`+=` -> `=`)",
        R_SIM,
        "        self.errors += 1\n",
        "        self.errors = 1\n",
        "C§16",
        _t(LOG, "test_each_refused_prompt_fails_its_requests_and_counts_one_error"),
    ),
    M(
        "_terminal: a request at max_seq_len tokens keeps decoding (`>=` -> `>`)",
        R_SIM,
        "or n >= self.sc.max_seq_len",
        "or n > self.sc.max_seq_len",
        "C§16",
        _t(LOG, "test_a_request_stops_at_max_seq_len_tokens"),
    ),
    M(
        "TensorEngine: the draft-KV map without the scenario's LRU cap",
        R_SIM,
        "self.dmap = SizedDraftKvMap(self.be, self.model, sc.max_draft_kv_seqs)",
        "self.dmap = SizedDraftKvMap(self.be, self.model, None)",
        "C§7.1",
        _t(LOG, "test_the_draft_map_cap_of_the_scenario_evicts_the_least_recent_state"),
    ),
    M(
        "TensorEngine: ragged admission granted in every world, not only WB",
        R_SIM,
        'granted = sc.world == "WB" and self.per_seq',
        "granted = self.per_seq",
        "M§17",
        _t(LOG, "test_the_engine_sets_up_its_scheduler_from_the_scenario"),
    ),
    # ------------------------------------------------------------------ simulator: the steps
    M(
        "_decode_inner: the bonus token committed when only the accepted ones remain (`>` -> "
        "`>=`)",
        R_SIM,
        "([targets[r][a]] if rem > a and budgets[r] > a else [])",
        "([targets[r][a]] if rem >= a and budgets[r] > a else [])",
        "C§16",
        _t(STEPS, "test_a_row_commits_no_more_than_its_max_new_tokens"),
    ),
    M(
        "_decode_inner: a cohort step that drops one column truncates nothing (`> 0` -> `> 1`)",
        R_SIM,
        "            if n_drop > 0:\n",
        "            if n_drop > 1:\n",
        "C§12.1",
        _t(STEPS, "test_a_cohort_step_that_drops_one_column_truncates_by_one"),
    ),
    M(
        "_decode_inner: the pending leads set to one column, not cleared, once cloned in",
        R_SIM,
        "            for i in ids:\n                self.pending[i] = 0\n"
        "            self.state.ragged_decode_supported",
        "            for i in ids:\n                self.pending[i] = 1\n"
        "            self.state.ragged_decode_supported",
        "C§5.5",
        _t(STEPS, "test_a_refused_draft_chain_fails_the_step_after_grouping"),
    ),
    M(
        "_defer: each row fed at the shared length, not its own position (`c - pad` -> `c`)",
        R_SIM,
        "        offsets = [c - pad for pad in lead]\n",
        "        offsets = [c for pad in lead]\n",
        "C§16",
        _t(STEPS, "test_a_deferred_step_is_one_plain_decode_at_each_rows_own_position"),
    ),
]
