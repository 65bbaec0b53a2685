"""Catalogue entries for the bugs mutmut's survivors taught: each is a mutation that mutmut
once made and the suite let live (a refusal order, a `continue` that became a `break`, a
boundary one off, a dtype or a margin dropped, an accounting rule half applied), rewritten
as a named, realistic change to the rule it breaks and now killed by the test that was
written for it, which each entry names (`conformance/...::test_...`). `REFERENCE_ENTRIES`
mutate `reference/` and join `CATALOGUE`; `PORT_ENTRIES` mutate the torch port (`gpu/`) and
join `PORT_CATALOGUE`; `mutation.catalogue` joins them.
"""

from __future__ import annotations

from raggedspec.mutation.mutant import R_ALIGN, R_DRAFT, R_MASKS, R_SCHED, M, Mutant

_C = "conformance/"
R_XS, R_MODEL, R_SIM = "reference/xs_rolling.py", "reference/model.py", "reference/simulator.py"
R_TRACE, R_TREAD = "reference/trace.py", "reference/trace_reader.py"
R_ACCEPT, R_SCEN = "reference/acceptance.py", "reference/scenario.py"
R_BACKEND = "reference/backend.py"
G_ATTN, G_PAGED, G_PBACK = "gpu/attention.py", "gpu/paged.py", "gpu/paged_backend.py"


def _t(file: str, test: str) -> str:
    return f"{_C}{file}::{test}"


A_CHK, D_LOOP, D_CHK = "test_align_checks.py", "test_draft_loop.py", "test_draft_checks.py"
XS_EDGE, LAYER = "test_xs_rolling_edges.py", "test_model_layer.py"
S_STATE, P_ATTN = "test_scheduler_state.py", "test_port_attention.py"
P_STORE, P_SLOTS = "test_paged_store.py", "test_paged_backend_slots.py"
T_FIELDS, PROTO = "test_trace_reader_fields.py", "test_backend_protocol.py"
ACCEPT, S_KEYS = "test_acceptance.py", "test_scenario_keys.py"

REFERENCE_ENTRIES: list[Mutant] = [
    # ------------------------------------------------------------------ reference/align.py
    M(
        "_dead_prefix_refusal: K strips before V refuses (`or` -> `and`)",
        R_ALIGN,
        "return _drop_front_refusal(slot.k, lead) or _drop_front_refusal(slot.v, lead)",
        "return _drop_front_refusal(slot.k, lead) and _drop_front_refusal(slot.v, lead)",
        "C§4.4 drop_dead_prefix",
        _t(A_CHK, "test_a_v_half_that_cannot_be_stripped_leaves_the_k_half_untouched"),
    ),
    M(
        "_slot_pad_refusal: K pads before V refuses (`or` -> `and`)",
        R_ALIGN,
        "return _front_pad_refusal(slot.k, target) or _front_pad_refusal(slot.v, target)",
        "return _front_pad_refusal(slot.k, target) and _front_pad_refusal(slot.v, target)",
        "C§4.2 front_pad_kv_cache",
        _t(A_CHK, "test_a_v_half_that_cannot_be_padded_leaves_the_k_half_untouched"),
    ),
    M(
        "first_mismatched_cache_len: skip a layer only when BOTH sides are XsRolling",
        R_ALIGN,
        "(slot.kind == XS or ref[layer].kind == XS)",
        "(slot.kind == XS and ref[layer].kind == XS)",
        "C§5.1",
        _t(A_CHK, "test_xs_slots_are_skipped_in_any_layer_where_either_side_is_xs"),
    ),
    M(
        "clone_in_cache_reporting_lead: report zeros, not the lazy alignment's real leads",
        R_ALIGN,
        "leads = inner.lead_pad if inner.lead_pad is not None else [0] * len(caches)",
        "leads = [0] * len(caches)",
        "C§5.4",
        _t(A_CHK, "test_without_per_sequence_the_lazy_alignment_leads_are_reported"),
    ),
    M(
        "_stack_layer: xs bases never reconciled (even with the flag off)",
        R_ALIGN,
        "XsRolling.stack(slots, reconcile_bases=not xs_per_seq)",
        "XsRolling.stack(slots, reconcile_bases=False)",
        "C§5.2",
        _t(A_CHK, "test_with_the_flag_off_xs_bases_are_reconciled_on_assembly"),
    ),
    # ------------------------------------------------------------------ reference/draft.py
    M(
        "group_drafting_loop: a group with no row stops the loop (`continue` -> `break`)",
        R_DRAFT,
        "                warned_empty = True\n            continue\n",
        "                warned_empty = True\n            break\n",
        "C§9.3",
        _t(D_LOOP, "test_a_skipped_group_warns_with_its_key_and_the_next_group_still_drafts"),
    ),
    M(
        "group_drafting_loop: a failed strip stops the write-back (`continue` -> `break`)",
        R_DRAFT,
        "                states[i].poisoned = True\n                continue\n",
        "                states[i].poisoned = True\n                break\n",
        "C§9.3",
        _t(D_LOOP, "test_a_failed_strip_of_one_row_leaves_the_next_row_written_back"),
    ),
    M(
        "extend_draft_kv_row: an empty span truncates a longer draft KV (`hi <= lo` -> `<`)",
        R_DRAFT,
        "    if hi <= lo:\n        return True\n",
        "    if hi < lo:\n        return True\n",
        "C§7.2",
        _t(D_CHK, "test_nothing_to_write_leaves_a_longer_draft_kv_untouched"),
    ),
    M(
        "extension_span: no seed on a two-token history (`L >= 2` -> `L > 2`)",
        R_DRAFT,
        "    if big_l >= 2:\n",
        "    if big_l > 2:\n",
        "C§7.2",
        _t(D_CHK, "test_extension_span_on_the_shortest_histories"),
    ),
    # ------------------------------------------------------------------ reference/masks.py
    M(
        "make_sliding_window_causal_mask_matrix: the channel policy ignores per-seq lens",
        R_MASKS,
        "        live = _ragged_live(b, past, per_seq_kv_lens, channel_lead)\n"
        "        if live is not None:\n            dead",
        "        live = _ragged_live(b, past, None, channel_lead)\n"
        "        if live is not None:\n            dead",
        "M§9.4",
        _t("test_masks.py",
           "test_the_sliding_window_entry_point_under_flash_and_with_per_seq_lens"),
    ),
    M(
        "sdpa_sliding_window: ratio 2 treated as Standard (`ratio <= 1` -> `<= 2`)",
        R_MASKS,
        "return w if ratio <= 1 else None",
        "return w if ratio <= 2 else None",
        "M§7",
        _t("test_masks.py", "test_small_routing_predicates_at_their_boundaries"),
    ),
    M(
        "ragged_union_mask: a resolved row at 0 refused (rows must be >= 1)",
        R_MASKS,
        "all(0 <= r <= q0 for r in rows)",
        "all(1 <= r <= q0 for r in rows)",
        "M§5",
        _t("test_masks.py",
           "test_ragged_union_mask_edges_a_row_at_zero_no_raw_keys_and_numeric_validity"),
    ),
    # ------------------------------------------------------------------ reference/xs_rolling.py
    M(
        "plan_xs_advance: a run of exactly the window rolls (`> window` -> `>=`)",
        R_XS,
        "if tok2 - base2 > window:",
        "if tok2 - base2 >= window:",
        "M§13",
        _t(XS_EDGE, "test_retention_and_the_window_at_their_boundaries"),
    ),
    M(
        "rollback_refusal: a rollback to exactly base + W refused (`<` -> `<=`)",
        R_XS,
        "    if base + window < length:\n",
        "    if base + window <= length:\n",
        "M§13",
        _t(XS_EDGE, "test_rollback_refusal_at_the_window_edge"),
    ),
    M(
        "_zero_behind_base: one column behind base left unzeroed (`> 0` -> `> 1`)",
        R_XS,
        "            if first_col > 0:\n",
        "            if first_col > 1:\n",
        "M§13",
        _t(XS_EDGE, "test_the_tail_holds_zeros_behind_base"),
    ),
    M(
        "set_row_lens: a rollback shifts ones in front of the tail, not zeros",
        R_XS,
        "                self.tail[i] = 0\n",
        "                self.tail[i] = 1\n",
        "M§13",
        _t(XS_EDGE, "test_a_rollback_shifts_the_tail_right_with_zeros_in_front"),
    ),
    M(
        "XsRolling.clone: a shallow copy (the clone shares its buffers)",
        R_XS,
        "return copy.deepcopy(self)",
        "return copy.copy(self)",
        "M§13",
        _t(XS_EDGE, "test_clone_is_deep"),
    ),
    M(
        "append_rows: the advance planned without the slot's own margin",
        R_XS,
        "self.tokens, self.base, self.window, t_new, self.ratio, self.span, self.margin\n",
        "self.tokens, self.base, self.window, t_new, self.ratio, self.span\n",
        "M§13",
        _t(XS_EDGE, "test_the_slot_retains_by_its_own_margin"),
    ),
    # ------------------------------------------------------------------ reference/model.py
    M(
        "DecoderLayer.__init__: a compressed layer rotates with rope_theta",
        R_MODEL,
        "self.theta = cfg.compress_rope_theta if self.ratio else cfg.rope_theta",
        "self.theta = cfg.rope_theta",
        "M§11 RoPE",
        _t(LAYER, "test_a_layer_forward_is_its_documented_steps"),
    ),
    M(
        "DecoderLayer.forward: no inverse RoPE on the attention output",
        R_MODEL,
        "        o = apply_rope(o, offsets, cfg.rope_dims, self.theta, inverse=True)\n",
        "",
        "M§11 RoPE",
        _t(LAYER, "test_a_layer_forward_is_its_documented_steps"),
    ),
    M(
        "MtpBlock.forward_tokens_rows: a ragged group masked without row_q0",
        R_MODEL,
        "return self.layer.forward(fused, cache, pos, pos, None)",
        "return self.layer.forward(fused, cache, pos, None, None)",
        "C§10.1; M§23",
        _t(LAYER, "test_a_ragged_mtp_group_gives_each_row_its_own_result"),
    ),
    M(
        "MtpBlock.fuse: the hidden not read as float64",
        R_MODEL,
        "        h = np.asarray(h, dtype=np.float64)\n        tokens",
        "        h = np.asarray(h)\n        tokens",
        "C§10.1",
        _t(LAYER, "test_the_mtp_block_computes_in_float64_and_reads_token_ids_as_integers"),
    ),
    # ------------------------------------------------------------------ reference/scheduler.py
    M(
        "schedule: admitted replaced by this pass's run (`|=` -> `=`)",
        R_SCHED,
        "state.admitted |= {s.id for s in run}",
        "state.admitted = {s.id for s in run}",
        "M§16",
        _t(S_STATE, "test_a_sequence_held_by_max_seqs_stays_admitted"),
    ),
    M(
        "schedule: urgency kept only for the sequences no longer present",
        R_SCHED,
        "state.urgency.items() if i in present}",
        "state.urgency.items() if i not in present}",
        "M§15",
        _t(S_STATE,
           "test_urgency_accumulates_across_schedule_calls_and_is_dropped_with_the_sequence"),
    ),
    M(
        "schedule: the WA cap counts only the last new request (`n_new += new` -> `=`)",
        R_SCHED,
        "n_new += new",
        "n_new = new",
        "M§16",
        _t(S_STATE, "test_the_wa_cap_counts_every_new_request_it_admits"),
    ),
    M(
        "bucket_and_waitlist_seqs_waiting: the WA floor applied to a single bucket",
        R_SCHED,
        "    if len(buckets) <= 1:\n",
        "    if len(buckets) < 1:\n",
        "M§16",
        _t(S_STATE, "test_the_wa_floor_counts_only_passes_with_several_buckets"),
    ),
    M(
        "bucket_and_waitlist_seqs_waiting: urgency left out of the priority",
        R_SCHED,
        "            state.urgency.get(s.id, 0), s.n_tokens\n",
        "            0, s.n_tokens\n",
        "M§15",
        _t(S_STATE, "test_urgency_is_read_by_the_greedy_choice_and_absent_ids_have_none"),
    ),
    M(
        "_as_list: ids returned as given (a tuple never equals the last list)",
        R_SCHED,
        "return xs if isinstance(xs, list) else list(xs)",
        "return xs",
        "M§18",
        _t(S_STATE, "test_ids_compare_by_value_whatever_the_sequence_type"),
    ),
    M(
        "plan_engine_iteration: the prompt forward ignores no_kv_cache",
        R_SCHED,
        '"prompt", outcome.prompt, [], no_kv_cache,',
        '"prompt", outcome.prompt, [], False,',
        "M§20.1",
        _t(S_STATE, "test_a_plan_without_a_kv_cache_resets_after_both_forwards"),
    ),
    # ------------------------------------------------------------------ reference/simulator.py
    M(
        "SizedDraftKvMap.checkin: evicts at the cap, not above it (`>` -> `>=`)",
        R_SIM,
        "len(self.entries) > self.cap:",
        "len(self.entries) >= self.cap:",
        "C§7.1 draft map",
        _t("test_simulator_draft_map.py",
           "test_the_least_recently_checked_in_entry_is_evicted_above_the_cap"),
    ),
    # ------------------------------------------------------------------ reference/trace.py
    M(
        "_key_part: a negative bucket part read as text (`lstrip` -> `rstrip`)",
        R_TRACE,
        'if text.lstrip("-").isdigit():',
        'if text.rstrip("-").isdigit():',
        "trace.md CSV",
        _t("test_trace.py", "test_csv_cells_a_foreign_engine_writes_read_as_the_docs_say"),
    ),
    M(
        "_read_csv: the row's seq read into the step fields (`[1:10]` -> `[1:11]`)",
        R_TRACE,
        "for k in CSV_COLUMNS[1:10]:",
        "for k in CSV_COLUMNS[1:11]:",
        "trace.md CSV",
        _t("test_trace.py", "test_the_csv_form_reads_back_typed_as_the_jsonl_step"),
    ),
    M(
        "read_trace: a blank line ends the trace (`continue` -> `break`)",
        R_TRACE,
        "            if not line:\n                continue\n",
        "            if not line:\n                break\n",
        "trace.md JSONL",
        _t("test_trace.py", "test_an_engine_trace_without_header_or_type_reads_as_steps"),
    ),
    # ------------------------------------------------------------------ reference/trace_reader.py
    M(
        "_csv_record: group_u / group_start not range-checked",
        R_TREAD,
        '    for col, v in (("group_u", gu), ("group_start", gs)):\n'
        "        if v is not None and _nonneg_int(v):\n"
        "            problems.field(n, col, v, _nonneg_int(v))\n",
        "",
        "trace.md Reading a trace",
        _t(T_FIELDS, "test_a_bad_csv_cell_is_the_one_line_naming_its_column"),
    ),
    M(
        "_show: a 61-character value shown whole (`<= 60` -> `<= 61`)",
        R_TREAD,
        "return text if len(text) <= 60 else text[:57] + \"...\"",
        "return text if len(text) <= 61 else text[:57] + \"...\"",
        "trace.md Reading a trace",
        _t(T_FIELDS, "test_each_bad_value_is_the_one_line_naming_field_value_and_rule"),
    ),
    M(
        "_read_jsonl: a line that is not JSON ends the reading (`continue` -> `break`)",
        R_TREAD,
        '                problems.add(n, f"not a JSON object ({exc})")\n                continue\n',
        '                problems.add(n, f"not a JSON object ({exc})")\n                break\n',
        "trace.md Reading a trace",
        _t(T_FIELDS,
           "test_every_bad_line_is_reported_and_a_refused_step_is_not_the_previous_one"),
    ),
    # ------------------------------------------------------------------ reference/acceptance.py
    M(
        "_Thresholds.accepted: a draw equal to its threshold accepted (`>=` -> `>`)",
        R_ACCEPT,
        "wrong = draws.astype(np.int64) >= self.thresholds(seq)[:, :m]",
        "wrong = draws.astype(np.int64) > self.thresholds(seq)[:, :m]",
        "simulator.md Acceptance models",
        _t(ACCEPT, "test_a_draft_is_right_iff_its_draw_is_below_the_threshold"),
    ),
    M(
        "key_hash: the seed multiplied by a mistyped FNV prime",
        R_ACCEPT,
        "np.array([(int(seed) * 0x100000001B3 + int(salt))",
        "np.array([(int(seed) * 0x1000000001B3 + int(salt))",
        "simulator.md Acceptance models",
        _t(ACCEPT, "test_key_hash_is_the_documented_composition"),
    ),
    M(
        "ModelOracle.draft: an n = 0 call counted as a drafting verify (`<= 0` -> `< 0`)",
        R_ACCEPT,
        "        if n <= 0:\n            return []\n        big_l = len(context)\n",
        "        if n < 0:\n            return []\n        big_l = len(context)\n",
        "simulator.md Acceptance models",
        _t(ACCEPT, "test_the_model_oracle_streams_and_counts_its_drafting_verifies"),
    ),
    M(
        "load_accept_file: eight missing sequences marked as cut (`> 8` -> `>= 8`)",
        R_ACCEPT,
        "{' ...' if len(missing) > 8 else ''}",
        "{' ...' if len(missing) >= 8 else ''}",
        "simulator.md Acceptance models",
        _t(ACCEPT, "test_the_accept_file_refusals_name_the_file_and_what_is_wrong"),
    ),
    # ------------------------------------------------------------------ reference/scenario.py
    M(
        "_apply_overrides: key=a=b split at the last '=' (`partition` -> `rpartition`)",
        R_SCEN,
        'k, _, v = o.partition("=")',
        'k, _, v = o.rpartition("=")',
        "simulator.md Keys, defaults and ranges",
        _t(S_KEYS, "test_overrides_as_a_dict_and_as_key_value_strings"),
    ),
    M(
        "load_scenario: the generator's default prompt_len 17, not 16",
        R_SCEN,
        '"prompt_len": _int_range("prompt_len", data.get("prompt_len", 16), 1),',
        '"prompt_len": _int_range("prompt_len", data.get("prompt_len", 17), 1),',
        "simulator.md Keys, defaults and ranges",
        _t(S_KEYS, "test_the_generator_defaults"),
    ),
    # ------------------------------------------------------------------ reference/backend.py
    M(
        "missing_methods: a method absent from a non-Backend object not counted as missing",
        R_BACKEND,
        "if getattr(type(backend), m, None) in (None, getattr(Backend, m))]",
        "if getattr(type(backend), m, None) is getattr(Backend, m)]",
        "backend protocol",
        _t(PROTO, "test_missing_methods_names_what_a_subclass_leaves_to_the_base"),
    ),
    M(
        "NumpyBackend.to_numpy: the caller's array itself, not a copy",
        R_BACKEND,
        "return np.array(x, copy=True)",
        "return np.asarray(x)",
        "backend protocol",
        _t(PROTO, "test_to_numpy_returns_a_copy"),
    ),
    M(
        "NumpyBackend._slot_view: an unmaterialized K half copied as if it held a buffer",
        R_BACKEND,
        'return {"k": None if k is None else k.copy(),',
        'return {"k": k.copy(),',
        "backend protocol",
        _t("test_backend_views.py", "test_materialize_reads_unmaterialized_slots_as_none_halves"),
    ),
]

PORT_ENTRIES: list[Mutant] = [
    # ------------------------------------------------------------------ gpu/attention.py
    M(
        "port dsv4_attention: the union mask in float32, not the compute dtype",
        G_ATTN,
        "dev, cd = q.device, _compute_dtype(q.dtype)",
        "dev, cd = q.device, _compute_dtype(None)",
        "M§4 masks",
        _t(P_ATTN, "test_a_float64_caller_mask_keeps_its_float64_values_on_both_mask_paths"),
    ),
    M(
        "port dsv4_attention: the ragged union mask built without its dtype",
        G_ATTN,
        "rows, q0, valid, raw_base, keep, cfg.compress_ratio, t_c, cd\n",
        "rows, q0, valid, raw_base, keep, cfg.compress_ratio, t_c\n",
        "M§4 masks",
        _t(P_ATTN, "test_the_union_mask_reaches_attention_in_the_compute_dtype"),
    ),
    M(
        "port dsv4_attention: compressed K/V joined without the cast to the KV dtype",
        G_ATTN,
        "torch.cat([k_raw, compressed_kv.to(k.dtype)], dim=2)",
        "torch.cat([k_raw, compressed_kv], dim=2)",
        "M§4",
        _t(P_ATTN, "test_compressed_keys_join_in_the_kv_dtype_under_float64_queries"),
        subs=(("torch.cat([v_raw, compressed_kv.to(v.dtype)], dim=2)",
               "torch.cat([v_raw, compressed_kv], dim=2)"),),
    ),
    M(
        "port dsv4_attention_in_place: compressed K/V joined without the cast to the KV dtype",
        G_ATTN,
        "torch.cat([k_raw, compressed_kv.to(k_raw.dtype)], dim=2)",
        "torch.cat([k_raw, compressed_kv], dim=2)",
        "M§4",
        _t(P_ATTN, "test_compressed_keys_join_in_the_kv_dtype_under_float64_queries"),
        subs=(("torch.cat([v_raw, compressed_kv.to(v_raw.dtype)], dim=2)",
               "torch.cat([v_raw, compressed_kv], dim=2)"),),
    ),
    M(
        "port dsv4_attention_in_place: two keys before the window gathered (`- 1` -> `+ 1`)",
        G_ATTN,
        "keep = min(t_q + window - 1, top)",
        "keep = min(t_q + window + 1, top)",
        "M§4",
        _t(P_ATTN, "test_in_place_attention_never_reads_a_key_before_the_window"),
    ),
    # ------------------------------------------------------------------ gpu/paged.py
    M(
        "paged PageStore._grow: grows only to the pages needed (no doubling)",
        G_PAGED,
        "new = max(needed, 2 * n)",
        "new = needed",
        "kernels: paged growth",
        _t(P_STORE, "test_the_store_grows_to_at_least_twice_its_pages_and_counts_the_copy"),
    ),
    M(
        "paged _make_writable: a shared page 1 replaced without its prefix copied",
        G_PAGED,
        "if page != 0 and keep:",
        "if page > 1 and keep:",
        "kernels: copy on write",
        _t(P_STORE, "test_a_shared_first_page_is_copied_and_a_page_boundary_copies_nothing"),
    ),
    M(
        "paged _make_writable: the write start ignores the zero lead",
        G_PAGED,
        "lo = int(self.start[i] + n - self.zlead[i])",
        "lo = int(self.start[i] + n)",
        "kernels: page arithmetic",
        _t(P_STORE, "test_an_append_follows_a_shrunk_zero_lead_within_the_row_pages"),
    ),
    M(
        "paged _locate: zero-page columns read at offset 1, not 0",
        G_PAGED,
        "np.where(inside, logical % p, 0)",
        "np.where(inside, logical % p, 1)",
        "kernels: page arithmetic",
        _t(P_STORE, "test_pages_of_one_column_read_zero_leads_and_empty_slots_as_zeros"),
    ),
    # ------------------------------------------------------------------ gpu/paged_backend.py
    M(
        "paged_backend _stack_layer: shared xs bases not reconciled on clone-in",
        G_PBACK,
        "return stack_xs(slots, not xs_per_seq)",
        "return stack_xs(slots)",
        "kernels: paged clone-in",
        _t(P_SLOTS, "test_clone_in_reconciles_shared_xs_bases_and_keeps_per_sequence_ones"),
    ),
    M(
        "paged_backend PagedKv.drop_front: every row cut by at least one column",
        G_PBACK,
        "cut = np.maximum(lead - self.lead, 0)",
        "cut = np.maximum(lead - self.lead, 1)",
        "kernels: paged strip",
        _t(P_SLOTS, "test_a_strip_of_one_column_cuts_only_the_rows_it_reaches"),
    ),
]
