"""The masks dsv4 attention builds (masks-and-scheduling.md §3-§6): the raw keep span, the raw
and compressed validity, the ragged union mask and the caller-mask fold, on the reference and
on the port (`gpu.masks`) through one test body (`impl`). The masker's rules (§7-§10) are in
test_masks_masker.py.

Expected values come from the spec's worked examples or from brute-force loops over absolute
positions written here, never from the code under test. Masks hold only 0 and -inf, exact in
every float dtype, so every comparison is bit-exact, the port's float32 and bfloat16 masks
included. Refusals: the same class and message on both, where both state one; the port names
shapes as lists where the reference names tuples (each side's messages are tested as stated).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import (
    assert_refused,
    each_implementation,
    keep_bits,
    mask_rules,
)
from raggedspec.conformance.strategies import corner_lengths, leads_of, ragged_lengths
from raggedspec.reference.errors import MaskRefusal
from raggedspec.reference.masks import raw_keep_span

NEG = -np.inf


def union_valid(rules, t_q, q0, base, keep, window, t_c, ratio) -> np.ndarray:
    """The shared validity `[raw ++ compressed]` of one step, by the implementation's rules."""
    return np.concatenate([rules.raw_validity(t_q, q0, base, keep, window),
                           rules.compressed_validity(t_q, q0, t_c, ratio)], axis=1)


# ----------------------------------------------------------------------------- §3


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_pinned_values():
    assert raw_keep_span(1, 128, 2048) == (1920, 128)
    assert raw_keep_span(2048, 128, 2048) == (0, 2048)
    assert raw_keep_span(1, 8, 64) == (56, 8)
    assert raw_keep_span(1, 4, 7) == (3, 4)  # the smallest well-formed forward: keep = window
    assert raw_keep_span(1, 1, 0) == (0, 0)  # no keys at all is not malformed


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_equals_the_brute_force_reachable_set():
    narrowed = 0
    for window in (1, 2, 4, 8, 128):
        for t_k_full in (1, 3, 8, 129, 256, 2048):
            for t_q in (1, 2, 7, 64):
                q0 = t_k_full - t_q
                reachable = set()
                for r in range(t_q):
                    qp = q0 + r
                    lo = max(0, qp - window + 1)
                    reachable.update(range(lo, min(qp, t_k_full - 1) + 1))
                base, keep = raw_keep_span(t_q, window, t_k_full)
                assert base + keep == t_k_full
                assert reachable == set(range(base, t_k_full)), (window, t_k_full, t_q)
                narrowed += base > 0
    assert narrowed > 0  # non-degeneracy: at least one case drops keys


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_rejects_malformed_input():
    cases = [((-1, 4, 9), "t_q -1 and t_k_full 9 must be >= 0"),
             ((2, 4, -1), "t_q 2 and t_k_full -1 must be >= 0"),
             ((0, 4, 9), "t_q 0 must be >= 1: a forward with no query row reaches no key"),
             ((2, 0, 9), "window 0 must be >= 1 (dsv4 passes max(sliding_window, 1))")]
    for args, message in cases:
        with pytest.raises(ValueError) as e:
            raw_keep_span(*args)
        assert str(e.value) == message


# ----------------------------------------------------------------------------- §4 steps 5-6


@each_implementation
@pytest.mark.rule("dsv4 raw validity", "dsv4 compressed validity",
                  "dsv4 raw / compressed validity, port")
@given(t_q=st.integers(1, 9), extra=st.integers(0, 40), window=st.integers(1, 20),
       t_c=st.integers(0, 12), ratio=st.sampled_from([1, 2, 4, 8]))
def test_raw_and_compressed_validity_match_the_position_rules(impl, t_q, extra, window, t_c,
                                                              ratio):
    rules = mask_rules(impl)
    t_k_full = t_q + extra
    q0 = t_k_full - t_q
    base, keep = raw_keep_span(t_q, window, t_k_full)
    raw = rules.raw_validity(t_q, q0, base, keep, window)
    comp = rules.compressed_validity(t_q, q0, t_c, ratio)
    assert raw.shape == (t_q, keep) and comp.shape == (t_q, t_c)
    assert raw.dtype == comp.dtype == bool
    for r in range(t_q):
        qp = q0 + r
        for c in range(keep):
            kp = base + c
            assert raw[r, c] == (kp <= qp and kp > qp - window)
        assert raw[r, qp - base]  # the diagonal is always valid
        for b in range(t_c):
            # complete at or before the query: the block's last token (b+1)*ratio-1 <= qp
            assert comp[r, b] == ((b + 1) * ratio - 1 <= qp)


@pytest.mark.rule("dsv4 raw / compressed validity, port")
@given(rows=corner_lengths(1, 6, 60, boundaries=False), t_q=st.integers(1, 6),
       t_c=st.integers(0, 10), ratio=st.sampled_from([1, 4, 8]))
def test_the_ports_vector_validity_is_the_per_row_rule_stacked(rows, t_q, t_c, ratio):
    """The port's vectorized forms (one `[B]` vector of query positions) equal the scalar rule
    evaluated row by row."""
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu import masks as port
    from raggedspec.gpu.testing import assert_bit_exact

    ref = mask_rules("reference")
    vec = torch.tensor(rows)
    got = port.compressed_validity(t_q, vec, t_c, ratio)
    assert_bit_exact(got, np.stack([ref.compressed_validity(t_q, r, t_c, ratio) for r in rows]))
    bases = [max(r - 3, 0) for r in rows]
    got = port.raw_validity(t_q, vec, torch.tensor(bases), 7, 4)
    assert_bit_exact(got, np.stack([ref.raw_validity(t_q, r, b, 7, 4)
                                    for r, b in zip(rows, bases, strict=True)]))


@pytest.mark.rule("dsv4 raw / compressed validity, port")
@given(t_q=st.integers(0, 9), q0=st.integers(0, 60), base=st.integers(0, 60),
       keep=st.integers(0, 20), window=st.integers(1, 20), t_c=st.integers(0, 12),
       ratio=st.sampled_from([1, 2, 4, 8, 128]))
def test_the_ports_validity_equals_the_references_on_any_geometry(t_q, q0, base, keep, window,
                                                                   t_c, ratio):
    """Any query and key placement, not only a step's own: bit for bit."""
    ref, port = mask_rules("reference"), mask_rules("port")
    assert np.array_equal(port.raw_validity(t_q, q0, base, keep, window),
                          ref.raw_validity(t_q, q0, base, keep, window))
    assert np.array_equal(port.compressed_validity(t_q, q0, t_c, ratio),
                          ref.compressed_validity(t_q, q0, t_c, ratio))


@each_implementation
@pytest.mark.rule("ragged sliding-window masker policy", "dsv4 compressed validity")
def test_zero_sizes_are_not_malformed(impl):
    rules = mask_rules(impl)
    assert rules.raw_validity(0, 0, 0, 0, 1).shape == (0, 0)
    assert rules.compressed_validity(0, 0, 0, 0).shape == (0, 0)
    none = rules.compressed_validity(1, 0, 0, 0)  # no compressed key: no ratio needed
    assert none.shape == (1, 0) and none.dtype == bool


# ----------------------------------------------------------------------------- §5


@each_implementation
@pytest.mark.rule("dsv4 compressed validity", "ragged_union_mask", "ragged_union_mask, port")
def test_csa_worked_example_rows_6_4_2(impl):
    rules = mask_rules(impl)
    rows, t_q, t_k_full, q0, window, ratio, t_c = [6, 4, 2], 1, 7, 6, 4, 4, 1
    base, keep = raw_keep_span(t_q, window, t_k_full)
    assert (base, keep) == (3, 4)
    assert leads_of(rows) == [0, 2, 4]
    valid = union_valid(rules, t_q, q0, base, keep, window, t_c, ratio)
    assert valid.tolist() == [[True, True, True, True, True]]  # shared raw keeps 3..6
    mask = rules.ragged_union_mask(rows, q0, valid, base, keep, ratio, t_c)
    assert mask.shape == (3, 1, 1, 5)
    assert keep_bits(mask[:, 0, 0, :]).tolist() == [[1, 1, 1, 1, 1],
                                                    [1, 1, 1, 1, 1],
                                                    [0, 1, 1, 1, 0]]
    # negative control: the batch-wide threshold floor(7/4) = 1 would keep comp 0 for row 2
    assert rules.compressed_validity(1, q0, 1, ratio)[0, 0]
    assert [(r + 1) // ratio for r in rows] == [1, 1, 0]


@each_implementation
@pytest.mark.rule("ragged_union_mask", "ragged_union_mask, port")
def test_the_dead_prefix_dies_in_the_left_aligned_example(impl):
    """Rows 6, 4, 2 at q0 = 6 (leads 0, 2, 4), t_q 1, window 8: row i keeps columns
    `[lead_i, 6]` only (the spec's left-aligned picture)."""
    got = mask_rules(impl).ragged_union_mask([6, 4, 2], 6, np.ones((1, 7), dtype=bool), 0, 7,
                                             1, 0)
    assert keep_bits(got[:, 0, 0]).tolist() == [[1] * 7, [0, 0] + [1] * 5, [0] * 4 + [1] * 3]


@each_implementation
@pytest.mark.rule("ragged_union_mask", "ragged_union_mask, port")
@given(lengths=ragged_lengths(1, 6, 1, 40), t_q=st.integers(1, 9), window=st.integers(1, 48),
       ratio=st.sampled_from([1, 2, 4, 8, 16, 128]), extra_c=st.integers(0, 3),
       data=st.data())
def test_ragged_union_mask_equals_the_per_row_position_oracle(impl, lengths, t_q, window, ratio,
                                                              extra_c, data):
    """Each row's mask is its own sequence's validity, from absolute positions; on the port in
    float64, float32 and bfloat16 alike."""
    dtype = None
    if impl == "port":
        import torch

        dtype = data.draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    rules = mask_rules(impl, dtype)
    rows = list(lengths)
    q0 = max(rows)
    t_k_full = q0 + t_q
    t_c = t_k_full // ratio + extra_c
    base, keep = raw_keep_span(t_q, window, t_k_full)
    valid = union_valid(rules, t_q, q0, base, keep, window, t_c, ratio)
    got = keep_bits(rules.ragged_union_mask(rows, q0, valid, base, keep, ratio, t_c))
    for i, row in enumerate(rows):
        lead = q0 - row
        for r in range(t_q):
            qp_own = row + r  # the row's own position of query r
            for c in range(keep):
                own = base + c - lead  # the key's position in the row's own sequence
                assert got[i, 0, r, c] == (0 <= own <= qp_own and own > qp_own - window), (i, r, c)
            for b in range(t_c):
                assert got[i, 0, r, keep + b] == ((b + 1) * ratio <= qp_own + 1), (i, r, b)
            assert got[i, 0, r, :keep].any()  # no row is fully masked


@each_implementation
@pytest.mark.rule("ragged_union_mask", "ragged_union_mask, port")
def test_ragged_union_mask_edges_a_row_at_zero_no_raw_keys_and_numeric_validity(impl):
    rules = mask_rules(impl)
    # a row at position 0 (lead q0) is a resolved row; its diagonal stays live
    mask = rules.ragged_union_mask([0, 3], 3, np.ones((1, 4), dtype=bool), 0, 4, 4, 0)
    assert keep_bits(mask[:, 0, 0]).tolist() == [[0, 0, 0, 1], [1, 1, 1, 1]]
    # no raw keys: only the compressed half (block 0 complete for the row at 3: 4 <= 3 + 1)
    comp_only = rules.ragged_union_mask([3], 3, np.ones((1, 1), dtype=bool), 0, 0, 4, 1)
    assert keep_bits(comp_only[:, 0, 0]).tolist() == [[1]]
    # q0 0, ratio 1, only compressed keys: block 0 valid, block 1 not
    assert keep_bits(rules.ragged_union_mask([0], 0, np.ones((1, 2), dtype=bool), 0, 0, 1,
                                             2)).tolist() == [[[[1, 0]]]]
    # validity given as 0/1 numbers reads as booleans
    valid = np.array([[1, 0, 1, 1]])
    want = rules.ragged_union_mask([2, 3], 3, valid.astype(bool), 0, 4, 4, 0)
    for numeric in (valid, valid.astype(np.float64)):
        assert np.array_equal(rules.ragged_union_mask([2, 3], 3, numeric, 0, 4, 4, 0), want)


@each_implementation
@pytest.mark.rule("ragged_union_mask", "ragged_union_mask, port")
def test_ragged_union_mask_rejects_rows_that_skipped_the_resolver(impl):
    rules = mask_rules(impl)
    ok = np.ones((1, 7), dtype=bool)
    for rows in ([7, 6], [6, -1], [5, 4]):
        with pytest.raises(ValueError) as e:
            rules.ragged_union_mask(rows, 6, ok, 0, 7, 1, 0)
        assert str(e.value) == (f"rows {rows} must lie in [0, q0=6] with max == q0 "
                                "(resolve_ragged_rows first)")
    with pytest.raises(ValueError, match="^ragged_union_mask needs at least one row$"):
        rules.ragged_union_mask([], 6, ok, 0, 7, 1, 0)
    with pytest.raises(ValueError, match="t_k \\+ t_c = 6"):
        rules.ragged_union_mask([6], 6, ok, 0, 4, 1, 2)
    for base, t_k, t_c in ((-1, 7, 0), (0, 8, -1), (0, -1, 8)):
        with pytest.raises(ValueError) as e:
            rules.ragged_union_mask([6], 6, ok, base, t_k, 1, t_c)
        assert str(e.value) == f"raw_base {base}, t_k {t_k}, t_c {t_c} must be >= 0"


# ----------------------------------------------------------------------------- §6


def _local(t_q, n):
    return np.zeros((1, 1, t_q, n))


@each_implementation
@pytest.mark.rule("compose_caller_mask", "compose_caller_mask, port")
def test_compose_caller_mask_ignores_the_flash_placeholder(impl):
    rules = mask_rules(impl)
    local = np.where(np.eye(2, 5, dtype=bool), 0.0, NEG)[None, None]
    for placeholder in (None, np.zeros((1, 1)), np.full((1, 1, 1, 1), NEG)):
        out = rules.compose_caller_mask(local, placeholder, 2, 9, 4, 4, 1)
        assert np.array_equal(out, local)


@each_implementation
@pytest.mark.rule("compose_caller_mask", "compose_caller_mask, port")
def test_compose_caller_mask_slices_raw_columns_and_pads_compressed_with_zero(impl):
    t_q, t_k_full, raw_base, t_k, t_c = 2, 9, 4, 5, 2
    caller = np.zeros((t_q, t_k_full))
    caller[0, 3] = NEG  # before raw_base: sliced away
    caller[1, 6] = NEG  # raw column 6 -> union column 2
    out = mask_rules(impl).compose_caller_mask(_local(t_q, t_k + t_c), caller, t_q, t_k_full,
                                               raw_base, t_k, t_c)
    assert out.shape == (1, 1, t_q, t_k + t_c)
    want = np.ones((t_q, t_k + t_c), dtype=int)
    want[1, 2] = 0
    assert keep_bits(out[0, 0]).tolist() == want.tolist()  # compressed columns padded with 0


@each_implementation
@pytest.mark.rule("compose_caller_mask", "compose_caller_mask, port")
def test_compose_caller_mask_keeps_the_callers_compressed_columns_and_minus_inf_wins(impl):
    t_q, t_k_full, raw_base, t_k, t_c = 1, 6, 2, 4, 2
    caller = np.zeros((2, 1, t_q, t_k_full + t_c))
    caller[1, 0, 0, t_k_full + 1] = NEG  # row 1 kills compressed column 1
    local = np.zeros((2, 1, t_q, t_k + t_c))
    local[0, 0, 0, 0] = NEG
    out = mask_rules(impl).compose_caller_mask(local, caller, t_q, t_k_full, raw_base, t_k, t_c)
    assert keep_bits(out[:, 0, 0]).tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]


@each_implementation
@pytest.mark.rule("compose_caller_mask", "compose_caller_mask, port", "ragged_union_mask")
def test_compose_caller_mask_refusals_name_the_widths(impl):
    rules = mask_rules(impl)
    local = _local(2, 6)
    with pytest.raises(MaskRefusal, match="must be rank 2.*or rank 4.*rank 3"):
        rules.compose_caller_mask(local, np.zeros((1, 2, 8)), 2, 8, 4, 4, 2)
    with pytest.raises(MaskRefusal, match="query axis 3"):
        rules.compose_caller_mask(local, np.zeros((3, 8)), 2, 8, 4, 4, 2)
    with pytest.raises(MaskRefusal) as e:
        rules.compose_caller_mask(local, np.zeros((2, 7)), 2, 8, 4, 4, 2)
    assert str(e.value) == "attention_mask key axis 7 is neither t_k_full 8 nor t_k_full + t_c 10"
    with pytest.raises(ValueError) as e:  # raw columns [6, 10) reach past a key axis of 8
        rules.compose_caller_mask(local, np.zeros((2, 8)), 2, 8, 6, 4, 2)
    assert str(e.value) == "raw slice [6, 10) exceeds key axis 8"
    # a query axis of 1 broadcasts
    assert rules.compose_caller_mask(local, np.zeros((1, 10)), 2, 8, 4, 4, 2).shape == (1, 1, 2, 6)


@pytest.mark.rule("compose_caller_mask, port")
@given(data=st.data())
def test_the_ports_caller_fold_matches_the_reference_including_refusals(data):
    """Random local masks and caller masks of every rank, width and query axis, in float64,
    float32 and bfloat16: refused by both (same class and message) or equal bit for bit."""
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu.testing import assert_same_refusal, outcome

    dtype = data.draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    t_q = data.draw(st.integers(1, 4))
    t_k_full = data.draw(st.integers(t_q, 20))
    t_c = data.draw(st.integers(0, 4))
    raw_base = data.draw(st.integers(0, t_k_full - 1))
    t_k = t_k_full - raw_base
    b = data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    local = np.where(rng.random((b, 1, t_q, t_k + t_c)) < 0.7, 0.0, -np.inf)
    rank = data.draw(st.sampled_from([None, 1, 2, 3, 4, "placeholder"]))
    width = data.draw(st.sampled_from([t_k_full, t_k_full + t_c, t_k_full + t_c + 1]))
    q_axis = data.draw(st.sampled_from([t_q, 1, t_q + 1]))
    caller = None
    if rank == "placeholder":
        caller = np.zeros((1, 1))
    elif rank is not None:
        shape = {1: (width,), 2: (q_axis, width), 3: (1, q_axis, width),
                 4: (b, 1, q_axis, width)}[rank]
        caller = np.where(rng.random(shape) < 0.8, 0.0, -np.inf)
    sizes = (t_q, t_k_full, raw_base, t_k, t_c)
    p = outcome(mask_rules("port", dtype).compose_caller_mask, local, caller, *sizes)
    r = outcome(mask_rules("reference").compose_caller_mask, local, caller, *sizes)
    if assert_same_refusal(p, r, "compose_caller_mask"):
        assert np.array_equal(p[1], r[1])


@pytest.mark.rule("dsv4 compressed validity")
def test_the_references_caller_fold_computes_in_float64():
    from raggedspec.reference.masks import compose_caller_mask

    local = np.zeros((1, 1, 2, 6), dtype=np.float32)
    for width in (8, 10):  # the raw slice alone, and with the caller's compressed columns
        out = compose_caller_mask(local, np.zeros((2, width), dtype=np.float32), 2, 8, 4, 4, 2)
        assert out.dtype == np.float64
    assert compose_caller_mask(local, None, 2, 8, 4, 4, 2) is local  # no caller: no copy


# ----------------------------------------------------------------------------- malformed input


@pytest.mark.rule("ragged sliding-window masker policy", "dsv4 raw validity")
def test_the_references_malformed_validity_sizes_are_refused_with_the_stated_messages():
    rules = mask_rules("reference")
    raw = "t_q {}, q0 {}, raw_base {}, keep {} must be >= 0"
    cases = [
        (lambda: rules.raw_validity(-1, 0, 0, 3, 2), raw.format(-1, 0, 0, 3)),
        (lambda: rules.raw_validity(1, -1, 0, 3, 2), raw.format(1, -1, 0, 3)),
        (lambda: rules.raw_validity(1, 0, -1, 3, 2), raw.format(1, 0, -1, 3)),
        (lambda: rules.raw_validity(1, 0, 0, -1, 2), raw.format(1, 0, 0, -1)),
        (lambda: rules.raw_validity(1, 0, 0, 3, 0), "window 0 must be >= 1"),
        (lambda: rules.compressed_validity(-1, 0, 2, 4), "t_q -1, q0 0, t_c 2 must be >= 0"),
        (lambda: rules.compressed_validity(1, -1, 2, 4), "t_q 1, q0 -1, t_c 2 must be >= 0"),
        (lambda: rules.compressed_validity(1, 0, -1, 4), "t_q 1, q0 0, t_c -1 must be >= 0"),
        (lambda: rules.compressed_validity(1, 0, 2, 0),
         "compress ratio 0 must be >= 1 when there are 2 compressed keys"),
        (lambda: rules.ragged_union_mask([3], 3, np.ones((1, 4), dtype=bool), 0, 3, 4, 2),
         "valid shape (1, 4) must be [t_q, t_k + t_c = 5]"),
    ]
    for call, message in cases:
        assert_refused(ValueError, call, message)


@pytest.mark.rule("dsv4 raw / compressed validity, port", "ragged_union_mask, port")
def test_the_ports_malformed_validity_and_mask_inputs_are_refused_with_their_messages():
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu import masks as port
    from raggedspec.gpu.testing import to_port

    vec = torch.tensor
    ok = to_port(np.ones((1, 7), dtype=bool))
    msg = "t_q {}, keep {} must be >= 0 and window {} >= 1"
    cases = [
        (lambda: port.raw_validity(-1, 0, 0, 1, 1), msg.format(-1, 1, 1)),
        (lambda: port.raw_validity(1, 0, 0, -1, 1), msg.format(1, -1, 1)),
        (lambda: port.raw_validity(1, 0, 0, 1, 0), msg.format(1, 1, 0)),
        (lambda: port.raw_validity(1, -1, 0, 1, 1), "q0 and raw_base must be >= 0"),
        (lambda: port.raw_validity(1, 0, -1, 1, 1), "q0 and raw_base must be >= 0"),
        (lambda: port.raw_validity(1, vec([2, -1]), vec([0, 0]), 1, 1),
         "q0 and raw_base must be >= 0"),
        (lambda: port.compressed_validity(-1, 0, 2, 1), "t_q -1, q0 [0], t_c 2 must be >= 0"),
        (lambda: port.compressed_validity(1, 0, -1, 1), "t_q 1, q0 [0], t_c -1 must be >= 0"),
        (lambda: port.compressed_validity(1, [3, -1], 2, 1),
         "t_q 1, q0 [3, -1], t_c 2 must be >= 0"),
        (lambda: port.compressed_validity(1, vec([3, -1]), 2, 1),
         "t_q 1, q0 [3, -1], t_c 2 must be >= 0"),
        (lambda: port.compressed_validity(1, 0, 2, 0),
         "compress ratio 0 must be >= 1 when there are 2 compressed keys"),
        (lambda: port.ragged_union_mask(vec([6]), 6, to_port(np.ones((1, 4, 2), dtype=bool)),
                                        0, 3, 1, 1),
         "valid shape [1, 4, 2] must be [t_q, t_k + t_c = 4]"),
        (lambda: port.ragged_union_mask(vec([6]), 6, ok, 0, 4, 1, 2),
         "valid shape [1, 7] must be [t_q, t_k + t_c = 6]"),
        (lambda: port.ragged_union_mask(vec([[6, 4]]), 6, ok, 0, 7, 1, 0),
         "rows must be a 1-D vector, got shape [1, 2]"),
    ]
    for call, message in cases:
        assert_refused(ValueError, call, message)


@pytest.mark.slow
@pytest.mark.rule("dsv4 raw / compressed validity, port")
def test_the_ports_validity_is_built_on_the_requested_device():
    """The `device` argument is honoured (the meta device runs on any machine): q0 and
    raw_base are checked where they are, the result is built on `device`. Slow only because
    the first meta-device comparison of a process loads torch's meta kernels (about 2 s)."""
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu import masks as port

    vec = torch.tensor
    for q0, base in ((3, 1), (vec([3, 5]), vec([1, 2])), ([3, 5], [1, 2])):
        got = port.raw_validity(2, q0, base, 3, 2, device="meta")
        assert (got.device.type, got.dtype) == ("meta", torch.bool)
    for q0, t_c in ((3, 2), (vec([3, 5]), 2), (3, 0)):
        got = port.compressed_validity(2, q0, t_c, 2, device="meta")
        assert (got.device.type, got.dtype) == ("meta", torch.bool)
