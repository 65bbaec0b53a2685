"""An oracle for the test vectors: each vector function recomputed by calling its reference
rule function directly, with none of the vectors' adapters, backends or writer in between.

`ORACLE` maps a function key to `inputs -> outputs` in the consumer's table form
(examples/vectors_consumer.py), so running the consumer with it recomputes every written
expectation. The functions in `WITHOUT_ORACLE` take cache slots or assembled mask pieces that
only the backend builds; their vectors are pinned by the spec's worked examples and by the
port instead (conformance/test_vectors.py).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from raggedspec.reference import accounting, capability, dispatch, masks, rope, scheduler, step
from raggedspec.reference.attention import Dsv4AttentionConfig, dsv4_attention
from raggedspec.reference.capability import KvAdvance, KvAdvanceLatch
from raggedspec.vectors.policy_fns import cache_of

WITHOUT_ORACLE = {
    "masks/union_mask",
    "align/front_align",
    "align/strip_dead_prefix",
    "align/concat",
    "align/split",
    "align/front_align_draft_group",
}


def _pairs(proposed, targets):
    return [step.verify_proposed(p, t) for p, t in zip(proposed, targets, strict=True)]


def _ok(check, *args) -> dict:
    check(*args)  # a refusal propagates: the consumer compares it
    return {"ok": True}


def _capture_ops(ops: list) -> dict:
    slot, taken = dispatch.MtpHiddenCapture(), []
    act = {
        "arm": lambda: slot.arm(),
        "clear": lambda: slot.clear(),
        "store_rows": lambda off, h: slot.store_rows(off, h),
        "store": lambda start, h: slot.store(start, h),
    }
    for name, *args in ops:
        if name == "take":
            got = slot.take()
            taken.append(got and {"offsets": list(got[0].values), "h": got[1]})
        else:
            act[name](*args)
    return {"taken": taken}


def _latch(i: dict) -> dict:
    latch = KvAdvanceLatch(i["requested"], i["xs_per_seq"], i["admission"])
    got = [latch.kv_advance(cache_of(c, False)).value for c in i["calls"]]
    return {"decisions": got, "refusal": latch.refusal, "messages": latch.messages}


def _accumulate(i: dict) -> dict:
    total = accounting.MtpAcceptance()
    fired = [total.accumulate(accounting.from_fused_verify(*da), i["every"]) for da in i["steps"]]
    return {"fired": fired, "total": asdict(total)}


def _record_batch(i: dict) -> dict:
    tele = accounting.AcceptanceTelemetry(logging_enabled=False)
    for rows in i["batches"]:
        tele.record_batch(len(rows), [accounting.from_fused_verify(*da) for da in rows])
    by = [[b, asdict(c)] for b, c in sorted(tele.by_batch.items())]
    return {"by_batch": by, "total_batch_steps": tele.total.batch_steps}


def _bucket_keys(i: dict) -> dict:
    state = scheduler.SchedulerState(i["world"])
    state.admission = scheduler.RaggedAdmission(i["granted"], None)
    state.ragged_decode_supported = i["ragged_decode_supported"]
    running = [scheduler.SeqRecord(**r) for r in i["running"]]
    keys = scheduler.bucket_keys(running, state)
    return {"keys": [list(k) for k in keys],
            "ragged_bucket_len": scheduler.ragged_bucket_len(running, state.admission)}


def _instruction(i: dict) -> dict:
    ops = scheduler.engine_cache_instruction(
        i["world"], i["batch"], i["ids"], i["last_completion_ids"], i["no_kv_cache"],
        i["granted"], i["first_token_offset"])
    keys = ("kind", "load_preallocated_cache", "reset_non_granular")
    return {name: {k: getattr(op, k) for k in keys} for name, op in zip(("pre_op", "post_op"), ops,
                                                                          strict=True)}


def _capture_offsets(i: dict) -> dict:
    c = dispatch.resolve_capture_offsets(i["offsets"])
    return {"values": list(c.values), "describes": c.describes(i["b"]),
            "row": [c.row(r) for r in i["rows"]]}


def _attention(i: dict) -> dict:
    cfg = Dsv4AttentionConfig(i["compress_ratio"], i["sliding_window"], i["raw_prefix"],
                              i["row_q0"])
    return {"out": dsv4_attention(i["q"], i["k"], i["v"], i.get("compressed_kv"), None, cfg,
                                  sinks=i.get("sinks"))}


def _rope_positions(i: dict) -> dict:
    """M §11: row r's position t is offsets[r] + t (one offset broadcasts to the batch)."""
    if len(i["offsets"]) not in (1, i["b"]):
        raise ValueError("offsets fit neither one row nor the batch")
    off = np.array(i["offsets"] * (i["b"] if len(i["offsets"]) == 1 else 1), dtype=np.int64)
    return {"positions": off[:, None] + np.arange(i["t"], dtype=np.int64)[None, :]}


def _flag(rule):
    return lambda i: {"enabled": rule(i["value"])}


ORACLE = {
    "dispatch/resolve_ragged_rows": lambda i: {
        "rows": dispatch.resolve_ragged_rows(i["rows"], i["q0"], i["b"])},
    "dispatch/uniform_seqlen_offset": lambda i: {
        "offset": dispatch.uniform_seqlen_offset(i["offsets"])},
    "dispatch/resolve_row_offsets": lambda i: {
        "offsets": dispatch.resolve_row_offsets(i["per_seq"], i["shared"])},
    "dispatch/resolve_row_cache_lens": lambda i: {
        "row_cache_lens": dispatch.resolve_row_cache_lens(i["enabled"], i["cache_len"],
                                                          i["lead_pad"])},
    "dispatch/resolve_ragged_chain_starts": lambda i: {
        "starts": dispatch.resolve_ragged_chain_starts(i["starts"])},
    "dispatch/resolve_draft_leads": lambda i: {
        "leads": dispatch.resolve_draft_leads(i["enabled"], i["starts"])},
    "dispatch/ragged_row_q0": lambda i: {
        "row_q0": dispatch.ragged_row_q0(i["offsets"], i["per_seq_kv"])},
    "dispatch/draft_step_end_column": lambda i: {
        "end_column": dispatch.draft_step_end_column(i["start_pos"], i["b"], i["cached"])},
    "dispatch/resolve_capture_offsets": _capture_offsets,
    "dispatch/mtp_hidden_capture": lambda i: _capture_ops(i["ops"]),
    "draft/chain_starts": lambda i: {"starts": [
        dispatch.chain_start_of(c, u) for c, u in zip(i["cache_lens"], i["uncached"],
                                                       strict=True)]},
    "draft/draft_group_keys": lambda i: {"keys": [
        list(dispatch.draft_group_key(u, c, i["carries_per_row"]))
        for u, c in zip(i["uncached"], i["cache_lens"], strict=True)]},
    "draft/draft_groups": lambda i: {"groups": [
        [key[0], key[1], list(rows)] for key, rows in dispatch.draft_groups(
            i["uncached"], i["cache_lens"], i["may_draft"], i["w"], i["per_seq_advance"]).items()]},
    "step/mtp_window": lambda i: {"w": step.mtp_window(i["depth"])},
    "step/plan_step_window": lambda i: (lambda sw: {"uncached": list(sw.uncached), "ok": sw.ok})(
        step.plan_step_window(i["cache_lens"], i["tok_lens"], i["w"])),
    "step/window_verify_row": lambda i: {"row": step.window_verify_row(i["u"], i["j"])},
    "step/verify_accept": lambda i: {
        "accepted": [len(v.accepted) for v in _pairs(i["proposed"], i["targets"])]},
    "step/verify_proposed": lambda i: {
        "accepted": [v.accepted for v in _pairs(i["proposed"], i["targets"])],
        "rejections": [v.rejection and list(v.rejection)
                       for v in _pairs(i["proposed"], i["targets"])]},
    "step/n_cache_positions_to_drop": lambda i: (lambda v: {
        "commit_len": v.commit_len,
        "n_drop": step.n_cache_positions_to_drop(len(i["proposed"]), v)})(
        step.verify_proposed(i["proposed"], i["target"])),
    "step/budget_clamp": lambda i: (lambda budgets: {
        "budgets": budgets,
        "accepted": [step.budget_clamp(a, b) for a, b in zip(i["accepted"], budgets,
                                                              strict=True)]})(
        [step.token_budget(i["max_seq_len"], n) for n in i["tok_lens"]]),
    "step/plan_batch_step": lambda i: (lambda p: {
        "keep": p.keep, "n_drop": p.n_drop, "next_uncached": list(p.next_uncached)})(
        step.plan_batch_step(i["uncached"], i["accepted"], i["w"])),
    "step/plan_per_sequence_step": lambda i: (lambda p: {
        "committed": list(p.committed), "dropped": list(p.dropped),
        "next_uncached": list(p.next_uncached)})(
        step.plan_per_sequence_step(i["uncached"], i["accepted"], i["w"])),
    "step/window_guard": lambda i: {
        "guard": step.window_guard(i["row_cache_lens_is_some"], KvAdvance(i["advance"]))},
    "step/per_seq_advance": lambda i: {"per_seq_advance": step.per_seq_advance(
        i["assembled_here"], i["post_op_out"], KvAdvance(i["advance"]))},
    "capability/per_sequence_kv_requested": _flag(capability.per_sequence_kv_requested),
    "capability/xs_per_sequence_enabled": _flag(capability.xs_per_sequence_enabled),
    "capability/acceptance_logging_enabled": _flag(capability.acceptance_logging_enabled),
    "capability/fp8_kv_enabled": _flag(capability.fp8_kv_enabled),
    "capability/kv_window_retain": lambda i: {"retain": capability.kv_window_retain(i["window"])},
    "capability/mtp_tail_isq": lambda i: {
        "isq": capability.mtp_tail_isq(i["isq"], i["allow_sub_int8"])},
    "capability/seq_may_draft": lambda i: {"may_draft": capability.seq_may_draft(
        i["temperature"], i["frequency_penalty"], i["presence_penalty"],
        i["repetition_penalty"], i["dry"], i["custom_processor"])},
    "capability/cache_supports_per_sequence_advance": lambda i: _ok(
        capability.cache_supports_per_sequence_advance, cache_of(i["slots"], i["paged"]),
        i["xs_per_seq"]),
    "capability/model_masks_ragged_batches": lambda i: _ok(
        capability.model_masks_ragged_batches, cache_of(i["slots"], i["paged"])),
    "capability/draft_chain_carries_per_sequence_positions": lambda i: _ok(
        capability.draft_chain_carries_per_sequence_positions, cache_of(i["slots"], i["paged"])),
    "capability/batch_admission_admits_ragged_cohorts": lambda i: _ok(
        capability.batch_admission_admits_ragged_cohorts, i["admission"]),
    "capability/per_sequence_refusal": lambda i: (lambda r: {
        "refusal": r and {"class": type(r).__name__, "message": str(r)}})(
        capability.per_sequence_refusal(cache_of(i["slots"], i["paged"]), i["xs_per_seq"],
                                        i["admission"])),
    "capability/kv_advance": _latch,
    "scheduler/cache_bucket_len": lambda i: {
        "len": scheduler.cache_bucket_len(i["cache_len"], i["n_tokens"])},
    "scheduler/bucket_keys": _bucket_keys,
    "scheduler/select_running_bucket": lambda i: {"key": list(scheduler.select_running_bucket(
        {tuple(k): [None] * n for k, n in i["buckets"]},
        {tuple(k): v for k, v in i["priorities"]}, i["discrete"]))},
    "scheduler/issues_cache_in": lambda i: {"cache_in": scheduler.issues_cache_in(
        i["no_kv"], i["cohort_changed"], i["granted"])},
    "scheduler/engine_cache_instruction": _instruction,
    "accounting/from_fused_verify": lambda i: {
        "step": asdict(accounting.from_fused_verify(i["d"], i["a"]))},
    "accounting/from_verify": lambda i: {"step": asdict(accounting.from_verify(
        i["d"], step.verify_proposed(i["proposed"], i["target"])))},
    "accounting/accumulate": _accumulate,
    "accounting/record_batch": _record_batch,
    "masks/raw_keep_span": lambda i: dict(zip(
        ("raw_base", "keep"), masks.raw_keep_span(i["t_q"], i["window"], i["t_k_full"]),
        strict=True)),
    "masks/make_left_padded_causal_mask": lambda i: {"mask": masks.make_left_padded_causal_mask(
        i["b"], i["t_q"], i["past"], i["live"])},
    "masks/make_causal_mask_matrix": lambda i: {"mask": masks.make_causal_mask_matrix(
        i["b"], i["t_q"], i["past"], i["per_seq_kv_lens"], i["channel_lead"],
        i["flash_on_cuda"])},
    "masks/graph_mode_length_mask": lambda i: {
        "mask": masks.graph_mode_length_mask(i["positions"], i["cap"])},
    "masks/compose_caller_mask": lambda i: {"mask": masks.compose_caller_mask(
        i["local"], i.get("caller"), i["t_q"], i["t_k_full"], i["raw_base"], i["t_k"],
        i["t_c"])},
    "masks/sdpa_sliding_window": lambda i: {"window": masks.sdpa_sliding_window(i["ratio"],
                                                                                i["w"])},
    "masks/mask_must_be_applied_as_bias": lambda i: {
        "bias": masks.mask_must_be_applied_as_bias(i["dims"])},
    "rope/rope_positions": _rope_positions,
    "rope/apply_rope": lambda i: {"y": rope.apply_rope(
        i["x"], i["offsets"], i["rope_dims"], i["theta"], inverse=i["inverse"])},
    "rope/compressed_key_positions": lambda i: {
        "positions": rope.compressed_key_positions(i["t_c"], i["ratio"])},
    "attention/dsv4_attention": _attention,
}
