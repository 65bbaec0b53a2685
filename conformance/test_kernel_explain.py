"""The explanations of `raggedspec check-kernel` (docs/kernels.md "the rule that differs"),
word for word on small fixed cases: a kernel with one planted bug of a known class gets the
rule named, with the row, query, keys, pages or offset the docs promise. The planted kernels
change one thing of a correct adapter (a key set, a page table read, a row's position, the
sinks), so every number in an expected line follows from the case by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from raggedspec import kernel_adapters as A
from raggedspec.kernel_cases import Case, run_case

pytestmark = pytest.mark.rule("raggedspec check-kernel")


def explanation(report: str) -> list[str]:
    """The report's lines after the error line: the rule that differs and its details."""
    lines = report.splitlines()
    return lines[next(n for n, line in enumerate(lines) if line.startswith("max error")) + 1:]


def masked_padded(keep, heads=None):
    """The padded layout's SDPA (`sdpa_padded`, sinks included) with the key set
    `keep(qp [B, t_q, 1], kp [B, 1, T], window) -> bool` in place of the causal window
    (qp: query positions, -1 on padding slots; kp: key positions, negative on padding), in
    the query heads `heads` (None: all of them)."""
    def fn(q, k, v, attention_mask, position_ids, sliding_window=None, softmax_scale=None,
           sinks=None):
        key_pos = attention_mask.long().cumsum(dim=1) - 1
        qp, kp = position_ids[:, :, None], key_pos[:, None, :]
        live = (attention_mask[:, None, :] & (qp >= 0))[:, None]
        planted = live & keep(qp, kp, sliding_window)[:, None]
        if heads is None:
            ok = planted
        else:
            ok = (live & causal(qp, kp, sliding_window)[:, None]).expand(-1, q.shape[1], -1, -1)
            ok = ok.clone()
            ok[:, heads] = planted
        hk = A.kv_head_index(q.shape[1], k.shape[1], q.device)
        kk, vv = k[:, hk], v[:, hk]
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=ok, scale=softmax_scale)
        if sinks is not None:
            logits = (q @ kk.transpose(-1, -2)) * (softmax_scale or q.shape[-1] ** -0.5)
            lse = logits.masked_fill(~ok, float("-inf")).logsumexp(-1, keepdim=True)
            out = out * torch.sigmoid(lse - sinks[None, :, None, None])
        return torch.where(ok.any(dim=3, keepdim=True), out, torch.zeros_like(out))
    return fn


def causal(qp, kp, w, shift=0):
    """The reference's key set by position (the window's first key moved by `shift`)."""
    return (kp <= qp) & ((kp > qp - w + shift) if w is not None else True)


def first_query(qp):
    """Each row's first query position `[B, 1, 1]` (padding slots, -1, passed over)."""
    return torch.where(qp >= 0, qp, qp.max() + 1).amin(dim=1, keepdim=True)


# ------------------------------------------------------------------------- the window rules

# Rows of 2 and 1 queries over 5 and 2 keys, window 2: row 0's queries at positions 3 and 4
# (keys 2..3 and 3..4), row 1's at 1 (keys 0..1).
WINDOW_CASE = Case((2, 1), (5, 2), 2, 1, 2, 16, None, 7)


@pytest.mark.parametrize("keep, rule, where", [
    (lambda qp, kp, w: (kp <= qp) & (kp > first_query(qp) - w),
     "the window starts from the row's first query for every query",
     "row 0, query 1 (position 4): attends key 2, which its window of 2 excludes (keys 3..4)"),
    (lambda qp, kp, w: (kp <= qp) & (kp > qp.amax(dim=1, keepdim=True) - w),
     "the window starts from the row's last query for every query",
     "row 0, query 0 (position 3): does not attend key 2, which it should (keys 2..3)"),
    (lambda qp, kp, w: causal(qp, kp, w, shift=1),
     "the window keeps one key too few",
     "row 0, query 0 (position 3): does not attend key 2, which it should (keys 2..3)"),
    (lambda qp, kp, w: causal(qp, kp, w, shift=-1),
     "the window keeps one key too many",
     "row 0, query 0 (position 3): attends key 1, which its window of 2 excludes (keys 2..3)"),
], ids=["from_first", "from_last", "one_fewer", "one_more"])
def test_a_window_rule_is_named_with_the_first_query_it_moves(keep, rule, where):
    report = run_case(masked_padded(keep), "padded", WINDOW_CASE, "float32", "cpu")
    assert report is not None
    assert explanation(report) == [f"rule that differs: {rule}", f"  {where}"], report



def test_the_modulo_gqa_head_is_named_with_the_heads_it_reads():
    """A kernel reading KV head h % Hk (Hq 4 over Hk 2): query head 1 reads KV head 1, where
    the reference's h // (Hq / Hk) reads 0."""
    def modulo_heads(q, k, v, *rest, **kw):
        heads = torch.arange(q.shape[1]) % k.shape[1]
        return A.sdpa_padded(q, k[:, heads], v[:, heads], *rest, **kw)

    case = Case((2, 1), (5, 2), 2, 2, 2, 16, None, 7)
    report = run_case(modulo_heads, "padded", case, "float64", "cpu")
    assert report is not None
    assert explanation(report) == [
        "rule that differs: query head h reads KV head h % Hk, not h // (Hq / Hk)",
        "  row 0, query 0: query head 1 reads KV head 1; with 4 query heads over 2 KV heads it "
        "reads 0"], report


# ------------------------------------------------------------------------- page-table misreads


def paged_reading(misread):
    """sdpa_paged reading `misread(kv_indices, num_pages)` as the page list."""
    def fn(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, *rest, **kw):
        read = misread(kv_indices.long(), k_pages.shape[0]).to(kv_indices.dtype)
        return A.sdpa_paged(q, k_pages, v_pages, qo_indptr, kv_indptr, read, *rest, **kw)
    return fn


def kvcache_reading(misread):
    """sdpa_kvcache (paged) reading `misread(block_table, num_blocks)` as the block table."""
    def fn(q, k_cache, v_cache, *, block_table, **kw):
        read = misread(block_table.long(), k_cache.shape[0]).to(block_table.dtype)
        return A.sdpa_kvcache(q, k_cache, v_cache, block_table=read, **kw)
    return fn


def row_pages(arrays, i: int) -> list[int]:
    """Row i's page ids, read from the layout's table by the layout's docs."""
    if hasattr(arrays, "kv_indices"):
        ptr = arrays.kv_indptr.tolist()
        return arrays.kv_indices[ptr[i]: ptr[i + 1]].tolist()
    n = int(arrays.cache_seqlens[i])
    return arrays.block_table[i, : -(-n // arrays.k_cache.shape[1])].tolist()


def case_arrays(case: Case, layout: str):
    from raggedspec.gpu.layouts import to_layout
    from raggedspec.kernel_cases import build_batch

    return to_layout(build_batch(case, torch.float32, "cpu"), layout, case.page_size,
                     seed=case.seed)


# Rows of 0, 1 and 2 queries over 4, 4 and 6 keys in pages of 2 (2, 2 and 3 pages and one spare:
# 8 pages): row 0 verifies nothing, so row 1 is the first row a misread shows on, at its page 0.
PAGES_CASE = Case((0, 1, 2), (4, 4, 6), None, 1, 1, 16, 2, 3)
LATE, EARLY = (lambda t, n: torch.roll(t, -1, -1)), (lambda t, n: torch.roll(t, 1, -1))
HIGH, LOW = (lambda t, n: (t + 1) % n), (lambda t, n: (t - 1) % n)


@pytest.mark.parametrize("layout, reading, misread, rule, read_of", [
    ("paged", paged_reading, LATE, "each kv_indices entry is read one entry late",
     lambda pages, a: pages(1)[1]),
    ("paged", paged_reading, EARLY, "each kv_indices entry is read one entry early",
     lambda pages, a: pages(0)[-1]),
    ("paged", paged_reading, HIGH, "each page id is read one too high",
     lambda pages, a: (pages(1)[0] + 1) % 8),
    ("paged", paged_reading, LOW, "each page id is read one too low",
     lambda pages, a: (pages(1)[0] - 1) % 8),
    ("kvcache", kvcache_reading, LATE, "each block_table entry is read one column late",
     lambda pages, a: pages(1)[1]),
    ("kvcache", kvcache_reading, EARLY, "each block_table entry is read one column early",
     lambda pages, a: int(a.block_table[1, -1])),
    ("kvcache", kvcache_reading, HIGH, "each page id is read one too high",
     lambda pages, a: (pages(1)[0] + 1) % 8),
    ("kvcache", kvcache_reading, LOW, "each page id is read one too low",
     lambda pages, a: (pages(1)[0] - 1) % 8),
], ids=["paged_late", "paged_early", "paged_high", "paged_low", "kvcache_late",
        "kvcache_early", "kvcache_high", "kvcache_low"])
def test_a_page_table_misread_is_named_with_the_row_and_page_it_moves(layout, reading, misread,
                                                                    rule, read_of):
    """docs/kernels.md: the page list read one entry late or early, or each page id one off,
    named with the first verifying row it changes, its page 0's id and the id read instead."""
    arrays = case_arrays(PAGES_CASE, layout)
    pages = lambda i: row_pages(arrays, i)  # noqa: E731
    report = run_case(reading(misread), layout, PAGES_CASE, "float32", "cpu")
    assert report is not None
    assert explanation(report) == [
        f"rule that differs: page table: {rule}",
        f"  row 1 (4 keys): its page 0 is page id {pages(1)[0]}, the output is that of reading "
        f"{read_of(pages, arrays)} (its pages {pages(1)})"], report


@pytest.mark.parametrize("keys, shown", [(8, lambda p: f"{p}"), (9, lambda p: f"{p[:8]} ...")])
def test_a_long_page_list_is_cut_after_eight_pages(keys, shown):
    """A row's pages are listed up to 8, then `...` (pages of 1 key, each id read one too
    high)."""
    case = Case((1,), (keys,), None, 1, 1, 16, 1, 3)
    pages = row_pages(case_arrays(case, "paged"), 0)
    report = run_case(paged_reading(HIGH), "paged", case, "float32", "cpu")
    assert report is not None
    assert explanation(report)[1] == (  # keys + 1 pages: one spare
        f"  row 0 ({keys} keys): its page 0 is page id {pages[0]}, the output is that of "
        f"reading {(pages[0] + 1) % (keys + 1)} (its pages {shown(pages)})"), report


# ------------------------------------------------------------------------- one key of the set

# Hq 4 over Hk 2: query head 2 reads KV head 2 // 2 = 1 (the bug is planted there alone).
EXTRA_CASE = Case((1, 3, 4), (4, 6, 8), 1, 2, 2, 16, None, 5)
MISSING_CASE = Case((1, 2, 3), (3, 5, 6), None, 2, 2, 16, None, 5)


@pytest.mark.parametrize("case, keep, where", [
    (EXTRA_CASE, lambda qp, kp, w: causal(qp, kp, w) | (kp == qp + 2),
     "row 1, query 0 (position 3): attends key 5, which causality excludes (the query is at 3)"),
    (MISSING_CASE, lambda qp, kp, w: causal(qp, kp, w) & (kp != 0),
     "row 0, query 0 (position 2): does not attend key 0, which it should (every key up to "
     "the query)"),
], ids=["extra", "missing"])
def test_one_key_added_or_removed_is_named(case, keep, where):
    """docs/kernels.md step 4: a kernel whose query head 2 attends one key more (the key two
    after the query; window 1, so row 1's query 0 at 3 sees key 3 alone and key 5 besides) or
    one key fewer (each row's key 0) than the reference, which no rule of the list explains,
    is named by that key."""
    report = run_case(masked_padded(keep, heads=[2]), "padded", case, "float64", "cpu")
    assert report is not None
    assert explanation(report) == ["rule that differs: one key of the set", f"  {where}"], report


# ------------------------------------------------------------------------- the causal diagonal


def offset_padded(offset_of):
    """A padded kernel that puts row b's query j at `offset_of(q_lens, kv_lens, b) + j` (its
    window moving with it) in place of its own `kv_len - q_len + j`."""
    def keep(qp, kp, w):
        q_lens, kv_lens = (qp >= 0).sum(dim=1)[:, 0], kp.amax(dim=2)[:, 0] + 1
        q, k = q_lens.tolist(), kv_lens.tolist()
        moved = [offset_of(q, k, b) - (k[b] - q[b]) for b in range(len(q))]
        return causal(qp + torch.tensor(moved)[:, None, None], kp, w)
    return masked_padded(keep)


RULE = ("  the rule: causal alignment is bottom-right per row: query j of a row with q_len queries "
        "over kv_len keys sits at position kv_len - q_len + j, from the row's own lengths")
# Rows of 3, 1 and 2 queries over 8, 10 and 16 keys (own offsets 5, 9, 14; max kv_len 16, max
# q_len 3), window 8: row 1's query sits at 9 and sees keys 2..9; put at d it sees keys
# d - 7..d (those of 0..9), a different set for every d from -3 to 16.
FIT_CASE = Case((3, 1, 2), (8, 10, 16), 8, 1, 1, 8, None, 11)
HEAD = "row 1 (10 keys, 1 queries): its queries sit at positions from {d} on, where its own "\
       "lengths put them from 9 on; "
KEYS = "row 1, query 0 (position 9): "
MISS = "does not attend keys {}, which it should (keys 2..9)"
EXTRA01 = "attends keys 0, 1 (2 keys), which its window of 8 excludes (keys 2..9)"


@pytest.mark.parametrize("d, source, words", [
    (5, "row 0's (its kv_len - q_len)", f"{KEYS}{EXTRA01}; " + MISS.format("6, 7, 8, 9 (4 keys)")),
    (14, "row 2's (its kv_len - q_len)", KEYS + MISS.format("2, 3, 4, 5, 6 (5 keys)")),
    (0, "0: top-left", f"{KEYS}attends key 0, which its window of 8 excludes (keys 2..9); "
     + MISS.format("2, 3, 4, 5, 6, 7, ... (8 keys)")),
    (15, "the batch's widest row's: max kv_len - q_len",
     KEYS + MISS.format("2, 3, 4, 5, 6, 7 (6 keys)")),
    (13, "the batch's widest row's: max kv_len - max q_len",
     KEYS + MISS.format("2, 3, 4, 5 (4 keys)")),
    (7, "kv_len - the batch's max q_len", f"{KEYS}{EXTRA01}; " + MISS.format("8, 9 (2 keys)")),
    (1, "no other length of the batch",
     f"{KEYS}{EXTRA01}; " + MISS.format("2, 3, 4, 5, 6, 7, ... (8 keys)")),
    (-3, "no other length of the batch",  # -t_q: the lowest offset tried
     "query 0 then attends no key, so its output is 0 (as if the query attended no key)"),
], ids=lambda x: str(x) if isinstance(x, int) else None)
def test_one_rows_causal_offset_is_named_by_where_it_comes_from(d, source, words):
    """docs/kernels.md step 3: row 1 alone put at offset d is found by trying every offset,
    and d is named by the first length of the batch it equals (another row's offset, 0, the
    widest row's with the row's or the longest query count, the row's keys less the longest
    query count), with the keys its query then attends or misses."""
    fn = offset_padded(lambda q, k, b: d if b == 1 else k[b] - q[b])
    report = run_case(fn, "padded", FIT_CASE, "float64", "cpu")
    assert report is not None
    assert explanation(report) == [
        f"rule that differs: the causal diagonal of row 1 is at offset {d}, which is {source}, "
        "not its own kv_len - q_len = 9", "  " + HEAD.format(d=d) + words, RULE], report


def test_an_offset_past_the_widest_row_is_not_tried():
    """Offsets are tried from -t_q to T (the widest row's kv_len, 16): row 2 put at 17 (keys
    10..15 and 11..15, no other offset's) is left to the plain difference."""
    fn = offset_padded(lambda q, k, b: 17 if b == 2 else k[b] - q[b])
    report = run_case(fn, "padded", FIT_CASE, "float64", "cpu")
    assert report is not None
    assert explanation(report)[0].endswith("no single changed rule or one-key change explains it")


def test_a_fitted_offset_keeps_the_sinks():
    """With sinks, the row recomputed at the fitted offset keeps them (else it matches no
    offset)."""
    case = Case(FIT_CASE.q_lens, FIT_CASE.kv_lens, 8, 1, 1, 8, None, 11, sinks=True)
    fn = offset_padded(lambda q, k, b: 5 if b == 1 else k[b] - q[b])
    report = run_case(fn, "padded", case, "float64", "cpu")
    assert report is not None
    assert explanation(report)[0] == ("rule that differs: the causal diagonal of row 1 is at "
                                      "offset 5, which is row 0's (its kv_len - q_len), not its "
                                      "own kv_len - q_len = 9"), report


def test_every_offset_source_that_matches_is_listed():
    """Rows of 1 query over 4 and 9 keys, window 2, every row put at the widest row's offset
    8: that is max kv_len - q_len, max kv_len - max q_len and row 1's own offset alike; row 0's
    query at 8 then sees none of its 4 keys."""
    case = Case((1, 1), (4, 9), 2, 1, 1, 8, None, 2)
    fn = offset_padded(lambda q, k, b: max(k) - q[b])
    report = run_case(fn, "padded", case, "float64", "cpu")
    assert report is not None
    also = "  (on this case the output equally follows: the offset taken from "
    assert explanation(report) == [
        "rule that differs: the causal diagonal: each row's offset is taken from the batch's "
        "widest row: max kv_len - the row's own q_len, not from the row's own lengths",
        "  row 0 (4 keys, 1 queries): its queries sit at positions from 8 on, where its own "
        "lengths put them from 3 on; query 0 then attends no key, so its output is 0 (as if the "
        "query attended no key)", RULE,
        also + "the batch's widest row: max kv_len - max q_len)",
        also + "row 1's offset kv_len - q_len = 8 for every row)"], report


# ------------------------------------------------------------------------- sinks, raises, NaN


@pytest.mark.parametrize("group, tail", [(8, "]"), (9, ", ...]")])
def test_dropped_sinks_are_shown_by_their_first_eight_values(group, tail):
    """A padded kernel that leaves the sinks out: the report shows the batch's sinks (8 query
    heads in full, more cut after 8, each to 3 decimals) and the first query it changes."""
    from raggedspec.kernel_cases import build_batch

    case = Case((1,), (3,), None, 1, group, 8, None, 1, sinks=True)
    sinks = build_batch(case, torch.float64, "cpu").sinks.tolist()
    shown = ", ".join(f"{round(x, 3)}" for x in sinks[:8])
    report = run_case(lambda *a, sinks=None, **kw: A.sdpa_padded(*a, **kw), "padded", case,
                      "float64", "cpu")
    assert report is not None
    assert explanation(report) == [
        "rule that differs: the attention sinks are dropped from the softmax denominator",
        f"  sinks [{shown}{tail}: row 0, query 0, head 0 is the softmax over its keys alone",
    ], report


def ping(n: int, words: str):
    if n:
        pong(n - 1, words)
    raise ValueError(words)


def pong(n: int, words: str):
    ping(n, words)


def test_a_raising_kernel_is_shown_with_its_own_traceback():
    """The report names the exception and shows its traceback from the kernel's own frame
    on, ending at the exception's words (no blank line after them, even when they end in one)."""
    def shallow(*args, **kw):
        raise ValueError("bad head dim\n")

    report = run_case(shallow, "varlen", WINDOW_CASE, "float32", "cpu")
    lines = report.splitlines()
    at = lines.index("raised by your kernel function: ValueError: bad head dim")
    assert lines[at + 2] == "  Traceback (most recent call last):", report
    assert lines[at + 3].startswith('    File "') and lines[at + 3].endswith(", in shallow")
    assert report.endswith("\n  ValueError: bad head dim"), report


def test_a_deep_traceback_is_cut_to_its_last_twenty_lines():
    report = run_case(lambda *a, **kw: ping(30, "too deep"), "varlen", WINDOW_CASE, "float32",
                      "cpu")
    lines = report.splitlines()
    at = lines.index("raised by your kernel function: ValueError: too deep")
    shown = lines[at + 1:]
    assert len(shown) == 20 and all(line.startswith("  ") for line in shown), report
    assert shown[-1] == "  ValueError: too deep" and "in ping" in shown[-3], report


def test_a_nan_padding_slot_is_named_by_its_first_index():
    """Every padding query slot NaN: the report names the first, row 0's (it verifies
    nothing, so all its slots are padding) element [0, 0, 0, 0]."""
    def nan_pads(q, k, v, attention_mask, position_ids, *rest, **kw):
        out = A.sdpa_padded(q, k, v, attention_mask, position_ids, *rest, **kw)
        return out.masked_fill((position_ids < 0)[:, None, :, None], float("nan"))

    case = Case((0, 1, 3), (5, 9, 12), None, 1, 2, 8, None, 3)
    report = run_case(nan_pads, "padded", case, "float64", "cpu")
    assert report is not None and "is nan at [0, 0, 0, 0], a padding query's slot" in report


# ------------------------------------------------------------------------- the tolerance


def test_an_output_exactly_that_of_a_rule_matches_it_at_zero_tolerance():
    """The tolerance is inclusive: with a bound of 0, a float64 output that is exactly the
    reference's under a page list read late, with row 1 put at row 0's offset, or with one
    key left out, is named by that rule."""
    from raggedspec.gpu.layouts import from_layout
    from raggedspec.kernel_cases import build_batch
    from raggedspec.kernel_explain import attention_under, explain

    arrays = case_arrays(Case((1, 2), (4, 6), None, 1, 1, 8, 2, 3), "paged")
    batch = from_layout(arrays)
    late = from_layout(replace(arrays, kv_indices=LATE(arrays.kv_indices, None)))
    got = attention_under(late)
    assert explain(batch, got, attention_under(batch), 0.0, arrays).startswith(
        "rule that differs: page table: each kv_indices entry is read one entry late")

    batch = build_batch(FIT_CASE, torch.float64, "cpu")

    def row1_at_5(b, i):
        qp = torch.arange(b.q_lens[i])[:, None] + (5 if i == 1 else b.kv_lens[i] - b.q_lens[i])
        kp = torch.arange(b.k.shape[2])[None, :] - b.leads[i]
        return ((kp >= 0) & causal(qp, kp, b.window)).numpy()

    report = explain(batch, attention_under(batch, row1_at_5), attention_under(batch), 0.0)
    assert report.startswith("rule that differs: the causal diagonal of row 1 is at offset 5, "
                             "which is row 0's"), report

    # one query over keys 0 and 1 answering with key 1's value alone (exactly: one key's
    # softmax weight is 1): key 0 missing, found by the probe at zero tolerance too
    batch = build_batch(Case((1,), (2,), None, 1, 1, 8, None, 4), torch.float64, "cpu")
    ref = attention_under(batch)
    got = ref.copy()
    got[0, 0, 0] = batch.v[0, 0, 1].numpy()
    assert explain(batch, got, ref, 0.0) == (
        "rule that differs: one key of the set\n  row 0, query 0 (position 1): does not attend "
        "key 0, which it should (every key up to the query)")


def test_a_rule_within_the_bound_of_the_reference_still_names_the_first_row():
    """An output 1.8 times as far from the reference as the widest-row offset's (which is
    itself within the bound of the reference) follows that rule: the report names it, on
    row 0 (rows of 1 query over 4 and 9 keys, window 2, both put at 8)."""
    import numpy as np

    from raggedspec.kernel_cases import build_batch
    from raggedspec.kernel_explain import attention_under, explain

    batch = build_batch(Case((1, 1), (4, 9), 2, 1, 1, 8, None, 2), torch.float64, "cpu")

    def at_8(b, i):
        kp = np.arange(b.k.shape[2])[None, :] - b.leads[i]
        return (kp >= 0) & (kp <= 8) & (kp > 8 - 2)

    ref, alt = attention_under(batch), attention_under(batch, at_8)
    bound = float(np.abs(alt - ref).max())
    report = explain(batch, alt + 0.8 * (alt - ref), ref, bound)
    assert report.startswith(
        "rule that differs: the causal diagonal: each row's offset is taken from the batch's "
        "widest row: max kv_len - the row's own q_len, not from the row's own lengths\n"
        "  row 0 (4 keys, 1 queries): its queries sit at positions from 8 on"), report
