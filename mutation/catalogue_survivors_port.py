"""Catalogue entries for the bugs the survivors of mutmut's runs on the torch port's cache,
slot, model, XsRolling and draft-loop modules (`gpu/cache.py`, `gpu/slots.py`, `gpu/model.py`,
`gpu/xs_rolling.py`, `gpu/draft_loop.py`) showed the suite once missed: growth decided by rows
an append does not address, a buffer allocated with the wrong width or dtype, a handle or an
offset array shared instead of copied, a clamp, a margin or a sentinel dropped, a refusal after
the write it should prevent, a skipped draft group that ends the loop, a draft-KV extension
that accepts a capture it should refuse, a pooled attention that ignores compressed keys, a
half-precision input computed without its float32 upcast. Each is a named, realistic change
to the rule it breaks, run against the test written for it (`conformance/...::test_...`);
`ENTRIES` join `PORT_CATALOGUE` in `mutation.catalogue` (the reference-side survivor entries,
and the port's earlier ones, are in `catalogue_survivors.py`).
"""

from __future__ import annotations

from raggedspec.mutation.mutant import M, Mutant

_C = "conformance/"
G_CACHE, G_SLOTS, G_MODEL = "gpu/cache.py", "gpu/slots.py", "gpu/model.py"
G_XS, G_LOOP = "gpu/xs_rolling.py", "gpu/draft_loop.py"
P_KV, P_SLOTS, P_MODEL = "test_port_ragged_kv.py", "test_port_slots.py", "test_port_model_rules.py"
P_XS, P_LOOP = "test_port_xs_rolling_slot.py", "test_draft_loop_torch.py"
P_EXT = "test_draft_extension_torch.py"
P_EDGE, P_XSA = "test_port_slots_edges.py", "test_port_xs_rolling_append.py"
P_BR = "test_port_model_branches.py"
G_BACKEND, P_PROTO = "gpu/backend.py", "test_backend_torch_protocol.py"
P_FWD, P_ROWS = "test_backend_torch_forward.py", "test_backend_torch_rows.py"


def _t(file: str, test: str) -> str:
    return f"{_C}{file}::{test}"


ENTRIES: list[Mutant] = [
    # ------------------------------------------------------------------ gpu/cache.py
    M(
        "port RaggedKv.append: growth decided by every row, not only the addressed ones",
        G_CACHE,
        "self._grow_to((int(self._host[host_rows].max()) if known else int(start.max())) + t)",
        "self._grow_to((int(self._host.max()) if known else int(start.max())) + t)",
        "port: RaggedKv growth",
        _t(P_KV, "test_growth_is_decided_by_the_addressed_rows_only"),
    ),
    M(
        "port RaggedKv._grow_to: an append that exactly fills the capacity grows (`<=` -> `<`)",
        G_CACHE,
        "        if needed <= self.capacity:\n            return\n",
        "        if needed < self.capacity:\n            return\n",
        "port: RaggedKv growth",
        _t(P_KV, "test_an_append_that_exactly_fills_the_capacity_writes_into_the_shared_buffer"),
    ),
    # ------------------------------------------------------------------ gpu/slots.py
    M(
        "port TorchKv.append: the first append's V buffer takes K's width",
        G_SLOTS,
        "max(self.capacity, s, 1), k.dtype, k.device, v.shape[3]\n",
        "max(self.capacity, s, 1), k.dtype, k.device\n",
        "port: K/V slots",
        _t(P_SLOTS,
           "test_the_first_append_allocates_the_buffer_and_later_ones_grow_it_past_its_own_width"),
    ),
    M(
        "port TorchKv.bake: the slot keeps the caller's dead-prefix array (no copy)",
        G_SLOTS,
        "            self.lead = host_ints(dead).copy()\n",
        "            self.lead = host_ints(dead)\n",
        "port: K/V slots",
        _t(P_SLOTS, "test_bake_turns_alignment_offsets_into_physical_zeros"),
    ),
    M(
        "port RowXs.clone: the handle itself, so a rollback of the handle moves its clone",
        G_SLOTS,
        "return RowXs(self.geometry, self.ring, self.comp, self.row, self.tokens, self.base)",
        "return self",
        "port: XsRolling handles",
        _t(P_SLOTS, "test_xs_row_handles_follow_the_reference"),
    ),
    # ------------------------------------------------------------------ gpu/model.py
    M(
        "port TinyModel.__init__: the MTP heads' e_proj built from h_proj",
        G_MODEL,
        "_tensor(ref_model.mtp_heads.e_proj, dtype, self.device)",
        "_tensor(ref_model.mtp_heads.h_proj, dtype, self.device)",
        "port: model weights",
        _t(P_MODEL, "test_the_port_computes_with_the_references_own_weights"),
    ),
    M(
        "port MtpBlock.new_draft_cache: the draft KV in float64 whatever the model's dtype",
        G_MODEL,
        "cfg.max_seq_len, capacity, self.dtype, self.device\n",
        "cfg.max_seq_len, capacity, device=self.device\n",
        "port: model placement and dtype",
        _t(P_MODEL, "test_every_weight_cache_and_table_is_on_the_models_device_in_its_dtype"),
    ),
    M(
        "port DecoderLayer.forward: a compressed layer refuses a row subset after appending keys",
        G_MODEL,
        "        require(\n            not self.ratio or rows is None,\n"
        '            "a compressed layer runs on every row of its cache (rows must be None)",\n'
        "        )\n",
        "",
        "port: model layer",
        _t(P_MODEL, "test_a_compressed_layer_refuses_a_row_subset"),
        subs=((
            "        kv.append(k, k, rows=rows)\n",
            "        kv.append(k, k, rows=rows)\n"
            "        require(\n            not self.ratio or rows is None,\n"
            '            "a compressed layer runs on every row of its cache (rows must be None)",\n'
            "        )\n",
        ),),
    ),
    # ------------------------------------------------------------------ gpu/xs_rolling.py
    M(
        "port XsRolling.append_rows: a later append kept in its own dtype (not the slot's)",
        G_XS,
        "        x_new = x_new.to(self.ring.dtype)\n",
        "",
        "M§13",
        _t(P_XS, "test_the_first_append_sets_the_width_and_later_appends_take_the_slots_dtype"),
    ),
    M(
        "port plan_xs_advance: need_start not clamped at the start of the history",
        G_XS,
        "need_start = (g_done + 1 - span).clamp(min=0) * ratio",
        "need_start = (g_done + 1 - span) * ratio",
        "M§13",
        _t(P_XS, "test_the_plan_clamps_at_the_start_of_the_history"),
    ),
    M(
        "port plan_xs_advance: rows without a new block marked 0, not -1",
        G_XS,
        "none = torch.full_like(tokens, -1)",
        "none = torch.zeros_like(tokens)",
        "M§13",
        _t(P_XS, "test_the_plan_marks_rows_without_a_new_block_with_minus_one"),
    ),
    # ------------------------------------------------------------------ gpu/draft_loop.py
    M(
        "port draft_group_loop: a group the plan skips stops the loop (`continue` -> `break`)",
        G_LOOP,
        "        if plan is None:\n            continue\n",
        "        if plan is None:\n            break\n",
        "C§9.3",
        _t(P_LOOP,
           "test_an_unbatchable_uniform_group_is_skipped_with_a_warning_and_the_next_group_drafts"),
    ),
    M(
        "port _draft_group_plan: a uniform group's set_len checked against max_seq_len",
        G_LOOP,
        "refusal = set_len_refusal(starts[0], 0, first.capacity)",
        "refusal = set_len_refusal(starts[0], 0, first.max_seq_len)",
        "C§9.3",
        _t(P_LOOP, "test_a_uniform_group_whose_set_len_is_refused_is_skipped_with_a_warning"),
    ),
    M(
        "port extend_draft_kvs: a capture that does not describe the batch accepted (`or` -> "
        "`and`)",
        G_LOOP,
        "elif hidden.shape[0] != batch or not offsets.describes(batch):",
        "elif hidden.shape[0] != batch and not offsets.describes(batch):",
        "C§7.2",
        _t(P_EXT,
           "test_a_capture_that_does_not_describe_the_batch_poisons_every_row_as_misaligned"),
    ),
    M(
        "port extend_draft_kvs: a capture of another rank refused without its message",
        G_LOOP,
        "            batch_fail = StepRefusal(\n                f\"captured hidden has rank",
        "            batch_fail = StepRefusal(\n                f\"captured hidden of rank",
        "C§7.2",
        _t(P_EXT, "test_a_capture_of_another_rank_poisons_every_row_with_its_step_refusal"),
    ),
    M(
        "port extend_draft_kvs: a row without a draft state ends the extension (`continue` -> "
        "`break`)",
        G_LOOP,
        "        if state is None:\n            continue\n        ok, err = True, None\n",
        "        if state is None:\n            break\n        ok, err = True, None\n",
        "C§7.2",
        _t(P_EXT, "test_the_rows_after_a_row_without_a_state_are_extended"),
    ),
    M(
        "port extend_draft_kvs: a refused row's truncate not poisoning it",
        G_LOOP,
        "        if err is not None:\n            state.poisoned = True\n",
        "        if err is not None:\n            state.poisoned = False\n",
        "C§7.2",
        _t(P_EXT, "test_a_refused_truncate_poisons_that_row_only_and_stays_poisoned"),
    ),
    M(
        "port extend_draft_kvs: the token packing one column late",
        G_LOOP,
        "tok[r, lo + 1 : hi + 1] = toks[row][lo + 1 : hi + 1]",
        "tok[r, lo + 2 : hi + 2] = toks[row][lo + 1 : hi + 1]",
        "C§7.2",
        _t(P_EXT, "test_per_row_offsets_spans_of_different_lengths_and_a_capture_ending_early"),
    ),
    M(
        "port _extend_plan: nothing to write (`hi == lo`) still truncates and writes (`<=` -> `<`)",
        G_LOOP,
        "    if hi <= lo:\n        return True\n",
        "    if hi < lo:\n        return True\n",
        "C§7.2",
        _t(P_EXT, "test_nothing_to_write_leaves_the_row_fine_and_its_draft_kv_untouched"),
    ),
    M(
        "port _extend_plan: a state without a draft KV does not advance filled",
        G_LOOP,
        "    if cache is None:\n        state.filled = hi\n        return True\n",
        "    if cache is None:\n        return True\n",
        "C§7.2",
        _t(P_EXT, "test_a_state_without_a_draft_kv_only_advances_filled"),
    ),
    # ------------------------------------------------------------------ gpu/slots.py, edges
    M(
        "port shift_rows: a run that fills the buffer read one column short",
        G_SLOTS,
        "cols = src.clamp(min=0, max=max(width - 1, 0))[:, None, :, None]",
        "cols = src.clamp(min=0, max=max(width - 2, 0))[:, None, :, None]",
        "port: K/V slots",
        _t(P_EDGE, "test_shift_rows_reads_a_run_that_fills_the_buffer_up_to_its_last_column"),
    ),
    M(
        "port stack_kv: a batched slot stacked as one row, not row by row",
        G_SLOTS,
        "rows = [r for p in parts for r in (p.rows() if isinstance(p, TorchKv) else [p])]",
        "rows = list(parts)",
        "port: K/V slots",
        _t(P_EDGE, "test_stack_kv_takes_batched_slots_row_by_row"),
    ),
    M(
        "port stack_kv: K gathered along the head-dim axis",
        G_SLOTS,
        "k = _gather([s.k for s in sources], pos, idx, n, 2)",
        "k = _gather([s.k for s in sources], pos, idx, n, 3)",
        "port: K/V slots",
        _t(P_EDGE, "test_stack_kv_gathers_rows_of_buffers_of_different_widths"),
    ),
    M(
        "port stack_layer: the XsRolling bases not reconciled when xs_per_seq is off",
        G_SLOTS,
        "return stack_kv(slots) if slots[0].kind == NORMAL else stack_xs(slots, not xs_per_seq)",
        "return stack_kv(slots) if slots[0].kind == NORMAL else stack_xs(slots, False)",
        "port: K/V slots",
        _t(P_EDGE, "test_stack_layer_of_one_slot_and_of_xs_rows_reconciled_with_the_flag_off"),
    ),
    M(
        "port stack_xs: a row without a compressed block given one zero block",
        G_SLOTS,
        "rows[i].comp = like.comp.new_zeros((1, 0, like.comp.shape[2]))",
        "rows[i].comp = like.comp.new_zeros((1, 1, like.comp.shape[2]))",
        "port: K/V slots",
        _t(P_EDGE, "test_stack_xs_of_rows_without_a_compressed_block_keeps_comp_empty"),
    ),
    M(
        "port TorchKv.append: the buffer grown to the append's width, not the rows' need",
        G_SLOTS,
        "grow_physical(self.kv, int(self.own.max()) + s if self.kv.batch else s)",
        "grow_physical(self.kv, s)",
        "port: K/V slots",
        _t(P_EDGE, "test_an_append_after_a_strip_grows_the_buffer_past_max_seq_len_unrefused"),
    ),
    # ------------------------------------------------------------------ gpu/xs_rolling.py, edges
    M(
        "port XsRolling.append_rows: the plan without the slot's retention margin",
        G_XS,
        "            self.span,\n            self.margin,\n        ).rows\n",
        "            self.span,\n        ).rows\n",
        "M§13",
        _t(P_XSA, "test_the_retention_base_reads_the_slots_own_margin"),
    ),
    M(
        "port XsRolling.append_rows: an append reaching max_seq_len refused (`>` -> `>=`)",
        G_XS,
        "over = np.flatnonzero(tok_after > self.max_seq_len)",
        "over = np.flatnonzero(tok_after >= self.max_seq_len)",
        "M§13",
        _t(P_XSA, "test_an_append_may_reach_max_seq_len_and_the_next_is_refused"),
    ),
    # ------------------------------------------------------------------ gpu/model.py, branches
    M(
        "port dsv4_attention_rows: pooled rows over a compressed layer ignore its compressed keys",
        G_MODEL,
        "    if not is_standard_layer(compress_ratio) and compressed_kv is not None:\n",
        "    if is_standard_layer(compress_ratio) and compressed_kv is not None:\n",
        "C§5.3",
        _t(P_BR, "test_pooled_attention_over_a_compressed_layer_is_each_rows_reference_"
           "attention_alone"),
    ),
    M(
        "port dsv4_attention_rows: the compressed threshold from the end of the query, not its "
        "start",
        G_MODEL,
        "            t_q, host - t_q, compressed_kv.shape[2], compress_ratio, device=dev\n",
        "            t_q, host, compressed_kv.shape[2], compress_ratio, device=dev\n",
        "C§5.3",
        _t(P_BR, "test_pooled_attention_over_a_compressed_layer_is_each_rows_reference_"
           "attention_alone"),
    ),
    M(
        "port dsv4_attention_rows: compressed keys joined in their own dtype, not the cache's",
        G_MODEL,
        "        k_all = torch.cat([k_raw, compressed_kv.to(k_raw.dtype)], dim=2)\n",
        "        k_all = torch.cat([k_raw.to(compressed_kv.dtype), compressed_kv], dim=2)\n",
        "C§5.3",
        _t(P_BR, "test_pooled_compressed_keys_join_the_raw_keys_in_the_caches_dtype"),
    ),
    M(
        "port dsv4_attention_rows: a row with exactly t_q keys refused (`<` -> `<=`)",
        G_MODEL,
        "    short = np.flatnonzero(host < t_q)\n",
        "    short = np.flatnonzero(host <= t_q)\n",
        "C§5.3",
        _t(P_BR, "test_a_row_with_exactly_t_q_keys_is_attended_not_refused"),
    ),
    M(
        "port rms_norm: a half-precision input normalized in its own dtype (no float32 upcast)",
        G_MODEL,
        "    cd = compute_dtype(x.dtype)\n    xc = x.to(cd)\n",
        "    cd = x.dtype\n    xc = x.to(cd)\n",
        "port: model dtype",
        _t(P_BR, "test_rms_norm_of_a_half_input_is_the_float32_computation_rounded_once"),
    ),
    M(
        "port silu: a half-precision input computed in its own dtype (no float32 upcast)",
        G_MODEL,
        "    xc = x.to(compute_dtype(x.dtype))\n    return (xc / (1.0 + torch.exp(-xc)))",
        "    xc = x\n    return (xc / (1.0 + torch.exp(-xc)))",
        "port: model dtype",
        _t(P_BR, "test_silu_of_a_half_input_is_the_float32_computation_rounded_once"),
    ),
    M(
        "port RopeTables.get: a table grown one doubling too far (`<` -> `<=`)",
        G_MODEL,
        "            while n < needed:\n",
        "            while n <= needed:\n",
        "port: model",
        _t(P_BR,
           "test_a_rope_table_is_the_first_doubling_of_the_initial_size_that_covers_the_need"),
    ),
    # ------------------------------------------------------------------ gpu/backend.py
    M(
        "port TorchBackend.new_target_cache: a ratio-1 layer gets no history slot (`> 0` -> `> 1`)",
        G_BACKEND,
        "                  for r in cfg.compress_ratios if r > 0]",
        "                  for r in cfg.compress_ratios if r > 1]",
        "port: backend",
        _t(P_PROTO, "test_the_target_cache_has_the_references_slots"),
    ),
    M(
        "port TorchBackend.new_draft_cache: one draft store per width, whatever the KV heads",
        G_BACKEND,
        "        hd = (model.cfg.n_kv_heads, model.cfg.head_dim)\n",
        "        hd = (1, model.cfg.head_dim)\n",
        "port: backend",
        _t(P_PROTO, "test_a_fresh_backend_keeps_one_draft_store_per_kv_heads_and_width"),
    ),
    M(
        "port TorchBackend.to_numpy: a host array returned without a copy",
        G_BACKEND,
        "        return np.array(x, copy=True)\n",
        "        return np.asarray(x)\n",
        "port: backend",
        _t(P_PROTO, "test_to_numpy_copies_a_host_array"),
    ),
    M(
        "port TorchBackend.set_lens: K/V slots set to the history length and XsRolling to the "
        "K/V one",
        G_BACKEND,
        "            slot.set_len(xs_len if slot.kind == XS else kv_len)\n",
        "            slot.set_len(kv_len if slot.kind == XS else xs_len)\n",
        "port: backend",
        _t(P_PROTO, "test_set_lens_sets_kv_slots_and_xs_slots_to_their_own_lengths"),
    ),
    M(
        "port TorchBackend.front_align: K/V-only rows aligned with the XsRolling flag on",
        G_BACKEND,
        "return align.front_align_batch([NormalCache([kv]) for kv in kvs], xs_per_seq=False)",
        "return align.front_align_batch([NormalCache([kv]) for kv in kvs], xs_per_seq=True)",
        "port: backend",
        _t(P_PROTO, "test_front_align_refuses_an_xs_slot_with_the_xs_flag_off"),
    ),
    M(
        "port TorchBackend.prime_draft_kv: priming warns with the extension's text",
        G_BACKEND,
        "model, warnings, why=PRIME_MISALIGNED)",
        "model, warnings)",
        "port: backend",
        _t(P_PROTO, "test_priming_warns_the_prefix_cache_text_into_the_callers_list"),
    ),
    M(
        "port TorchBackend.forward: the layout refusal names the second bad row, not the first",
        G_BACKEND,
        "            i = int(bad[0])\n",
        "            i = int(bad[-1])\n",
        "port: backend",
        _t(P_FWD, "test_a_malformed_forward_is_refused_with_the_references_message"),
    ),
    M(
        "port TorchBackend.forward: a token outside the vocabulary not refused",
        G_BACKEND,
        "        require(tokens.min() >= 0 and tokens.max() < vocab,\n",
        "        require(tokens.min() >= -1 and tokens.max() < vocab,\n",
        "port: backend",
        _t(P_ROWS, "test_a_token_outside_the_vocabulary_is_refused_before_any_slot_changes"),
    ),
    M(
        "port TorchBackend._compressed_layer: the RoPE table sized for the offsets only",
        G_BACKEND,
        "        table = layer.ropes.get(layer.theta, int(offs.max()) + t)\n",
        "        table = layer.ropes.get(layer.theta, int(offs.max()))\n",
        "port: backend",
        _t(P_FWD, "test_a_step_past_the_rope_table_built_so_far_matches_the_reference"),
    ),
    M(
        "port TorchBackend._compressed_layer: the last physical column left out of the gather",
        G_BACKEND,
        "            idx = cols.clamp(min=0, max=kv.capacity - 1)[:, None, :, None]\n",
        "            idx = cols.clamp(min=0, max=kv.capacity - 2)[:, None, :, None]\n",
        "port: backend",
        _t(P_FWD, "test_a_live_run_ending_at_the_last_physical_column_compresses_it"),
    ),
    M(
        "port TorchBackend.mtp_step: a K/V slot stepped without the growth refusal",
        G_BACKEND,
        "        kv.check_append(t)\n        kv.grow_meta(t)\n"
        "        grow_physical(kv.kv, int(kv.own.max()) + t)\n",
        "        kv.capacity = max(kv.capacity, kv.current + t)\n"
        "        grow_physical(kv.kv, int(kv.own.max()) + t)\n",
        "port: backend",
        _t(P_FWD, "test_a_refused_mtp_step_on_a_kv_slot_leaves_it_as_it_was"),
    ),
    M(
        "port TorchBackend.propose_chain: a K/V slot's buffer pre-grown by less than the chain",
        G_BACKEND,
        "                grow_physical(kv.kv, int(kv.own.max()) + n)\n",
        "                grow_physical(kv.kv, int(kv.own.max()) - n)\n",
        "port: backend",
        _t(P_ROWS, "test_a_chain_on_a_kv_slot_near_max_seq_len_grows_it_as_the_reference"),
    ),
]
