"""The explanations of `raggedspec check-kernel` (docs/kernels.md "the rule that differs"),
word for word on small fixed cases: a kernel with one planted bug of a known class gets the
rule named, with the row, query, keys, pages or offset the docs promise. The planted kernels
change one thing of a correct adapter (a key set, a page table read, a row's position, the
sinks), so every number in an expected line follows from the case by hand."""

from __future__ import annotations

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


def masked_padded(keep):
    """The padded layout's SDPA (`sdpa_padded`, sinks included) with the key set
    `keep(qp [B, t_q, 1], kp [B, 1, T], window) -> bool` in place of the causal window
    (qp: query positions, -1 on padding slots; kp: key positions, negative on padding)."""
    def fn(q, k, v, attention_mask, position_ids, sliding_window=None, softmax_scale=None,
           sinks=None):
        key_pos = attention_mask.long().cumsum(dim=1) - 1
        qp, kp = position_ids[:, :, None], key_pos[:, None, :]
        ok = attention_mask[:, None, :] & (qp >= 0) & keep(qp, kp, sliding_window)
        heads = A.kv_head_index(q.shape[1], k.shape[1], q.device)
        kk, vv = k[:, heads], v[:, heads]
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=ok[:, None],
                                             scale=softmax_scale)
        if sinks is not None:
            logits = (q @ kk.transpose(-1, -2)) * (softmax_scale or q.shape[-1] ** -0.5)
            lse = logits.masked_fill(~ok[:, None], float("-inf")).logsumexp(-1, keepdim=True)
            out = out * torch.sigmoid(lse - sinks[None, :, None, None])
        return torch.where(ok.any(dim=2)[:, None, :, None], out, torch.zeros_like(out))
    return fn


def causal(qp, kp, w, shift=0):
    return (kp <= qp) & ((kp > qp - w + shift) if w is not None else True)


def first_query(qp):
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
