"""Port conformance: `gpu.xs_rolling.XsRolling.append_rows` at three edges of its rule, each
against the reference slot on the same appends: a slot built with a margin other than the
default keeps the history its own margin says (the retention base of masks-and-scheduling.md
§13 reads the slot's margin); an append that lands exactly on `max_seq_len` is accepted and
the next one is refused ("above max_seq_len", nothing changed); and a slot of no rows
allocates its buffers with no compressed column (the widest row's blocks: none)."""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.gpu.testing import assert_bit_exact, to_port
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import XsRolling as RefXs


def same_xs(port: XsRolling, ref: RefXs, what: str) -> None:
    got = port.to_reference()
    assert (got.tokens, got.base) == (ref.tokens, ref.base), f"{what}: tokens, base"
    assert (got.tail is None) == (ref.tail is None) and got.dim == ref.dim, f"{what}: dim"
    if ref.tail is not None:
        assert_bit_exact(got.tail, ref.tail, f"{what}: tail")
        assert_bit_exact(got.comp, ref.comp, f"{what}: comp")


@pytest.mark.rule("XsRolling append and compressor, port")
def test_the_retention_base_reads_the_slots_own_margin():
    """Ratio 2, span 1, margin 2 (window 4): 7 tokens keep history from
    `max(0, ((7 - 2) // 2 + 1 - 1) * 2) = 4`, 3 more from `((10 - 2) // 2) * 2 = 8`; the
    default margin (16) would keep everything and not fit the window of 4."""
    rng = np.random.default_rng(3)
    ref, port = RefXs(2, 1, None, 64, 2, 3, 2), XsRolling(2, 1, None, 64, 2, 3, 2)
    assert (port.window, port.margin) == (4, 2)
    for t, base in ((7, 4), (3, 8)):
        x = rng.standard_normal((2, t, 3))
        ref.append_rows(x)
        port.append_rows(to_port(x))
        assert port.host_base().tolist() == ref.base == [base, base]
        same_xs(port, ref, f"after {t} more")


@pytest.mark.rule("XsRolling append and compressor, port")
def test_an_append_may_reach_max_seq_len_and_the_next_is_refused():
    """`max_seq_len` 8: 8 tokens are accepted (tokens 8 is not above it); one more would
    hold 9, refused with the reference's message and nothing changed."""
    rng = np.random.default_rng(4)
    ref, port = RefXs(2, max_seq_len=8), XsRolling(2, max_seq_len=8)
    x = rng.standard_normal((1, 8, 3))
    ref.append_rows(x)
    port.append_rows(to_port(x))
    assert port.host_tokens().tolist() == ref.tokens == [8]
    same_xs(port, ref, "at max_seq_len")
    message = r"^xs row 0 would hold 9 tokens, above max_seq_len 8$"
    with pytest.raises(CacheRefusal, match=message):
        ref.append_rows(np.ones((1, 1, 3)))
    with pytest.raises(CacheRefusal, match=message):
        port.append_rows(to_port(np.ones((1, 1, 3))))
    same_xs(port, ref, "after the refusal")


@pytest.mark.rule("XsRolling append and compressor, port")
def test_a_slot_of_no_rows_allocates_no_compressed_column():
    """A slot of no rows appended 8 hidden rows (ratio 4): ring `[0, W, D]` and comp
    `[0, 0, D]`, as the reference's, whose comp is as wide as the most blocks of any row."""
    ref, port = RefXs(4, max_seq_len=64, batch=0), XsRolling(4, max_seq_len=64, batch=0)
    x = np.zeros((0, 8, 3))
    ref.append_rows(x)
    port.append_rows(to_port(x))
    assert port.comp.shape == (0, 0, 3) and port.ring.shape == (0, port.window, 3)
    assert port.to_reference().comp.shape == ref.comp.shape == (0, 0, 3)
    same_xs(port, ref, "no rows")
