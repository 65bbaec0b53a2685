"""The tensor vector functions: masks, RoPE positions and rotation, and the ragged verify
attention (`align_fns` holds the K/V slot rules).

Every adapter here takes a backend (`raggedspec.reference.backend.Backend`) and goes through its
protocol methods where the protocol has one (`union_mask`, `rope_positions`, `apply_rope`,
`dsv4_attention`), so the same adapter runs on the reference (`NumpyBackend`) and on a
port's backend; the other mask rules call the reference function. Float inputs are drawn
float64 from the case's generator; outputs that are arrays become tensors of the case.
"""

from __future__ import annotations

import numpy as np

from raggedspec.vectors.registry import Fn, fixed, generated, lengths, plain
from raggedspec.reference import masks, rope
from raggedspec.reference.attention import Dsv4AttentionConfig


def random_array(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """A float64 array of standard normal draws from `rng`."""
    return rng.standard_normal(shape).astype(np.float64)


# ------------------------------------------------------------------------------ masks


def _keep_span_cases(rng, n):
    return fixed(
        example_csa_rows_6_4_2={"t_q": 1, "window": 4, "t_k_full": 7},
        example_window_wider_than_keys={"t_q": 3, "window": 128, "t_k_full": 10},
        malformed_no_query_row={"t_q": 0, "window": 4, "t_k_full": 7},
    ) + generated(
        n,
        lambda shape, i: {
            "t_q": int(rng.integers(1, 6)),
            "window": int(rng.integers(1, 10)),
            "t_k_full": int(rng.integers(0, 30)),
        },
    )


def _union_mask_cases(rng, n):
    def make(shape, i):
        rows = lengths(rng, shape, 0, 24)
        t_q = int(rng.integers(1, 4))
        t_k = max(rows, default=int(rng.integers(0, 24))) + t_q
        ratio = int(rng.choice([0, 4, 8]))
        t_c = 0 if ratio == 0 else t_k // ratio
        return {
            "t_q": t_q,
            "t_k_full": t_k,
            "row_q0": rows if i % 9 != 8 else None,
            "window": int(rng.integers(1, 12)),
            "ratio": ratio,
            "t_c": t_c,
        }

    return fixed(
        example_csa_rows_6_4_2={
            "t_q": 1,
            "t_k_full": 7,
            "row_q0": [6, 4, 2],
            "window": 4,
            "ratio": 4,
            "t_c": 1,
        },
        example_uniform={
            "t_q": 1,
            "t_k_full": 7,
            "row_q0": [6, 6, 6],
            "window": 4,
            "ratio": 4,
            "t_c": 1,
        },
        example_verify_w3={
            "t_q": 3,
            "t_k_full": 13,
            "row_q0": [10, 7],
            "window": 8,
            "ratio": 4,
            "t_c": 3,
        },
        refusal_ahead={
            "t_q": 1,
            "t_k_full": 7,
            "row_q0": [7, 4, 2],
            "window": 4,
            "ratio": 4,
            "t_c": 1,
        },
    ) + generated(n, make)


def _union_mask(b, i):
    return {
        "mask": b.to_numpy(
            b.union_mask(i["t_q"], i["t_k_full"], i["row_q0"], i["window"], i["ratio"], i["t_c"])
        )
    }


def _left_padded_cases(rng, n):
    def make(shape, i):
        live = lengths(rng, shape, 0, 16)
        past = max(live, default=0) + (1 if i % 7 == 6 else 0) - (1 if i % 11 == 10 and live else 0)
        return {
            "b": len(live) + (1 if i % 13 == 12 else 0),
            "t_q": int(rng.integers(1, 4)),
            "past": max(past, 0),
            "live": live,
        }

    return fixed(
        example_lives_6_2={"b": 2, "t_q": 2, "past": 6, "live": [6, 2]},
        refusal_width={"b": 3, "t_q": 1, "past": 6, "live": [6, 2]},
        refusal_live_exceeds_past={"b": 2, "t_q": 1, "past": 6, "live": [7, 2]},
    ) + generated(n, make)


def _graph_mask_cases(rng, n):
    return fixed(example_cap_8={"positions": [3, 7, 9], "cap": 8}) + generated(
        n,
        lambda shape, i: {"positions": lengths(rng, shape, 0, 20), "cap": int(rng.integers(0, 16))},
    )


def _causal_matrix_cases(rng, n):
    def make(shape, i):
        lens = lengths(rng, shape, 0, 12)
        b = max(len(lens), 1)
        past = max(lens, default=int(rng.integers(0, 12)))
        lp = [past - x for x in lens] if lens else None
        mode = i % 3
        return {
            "b": b,
            "t_q": int(rng.integers(1, 3)),
            "past": past,
            "per_seq_kv_lens": lens if mode == 0 and lens else None,
            "channel_lead": lp if mode == 1 else None,
            "flash_on_cuda": i % 4 == 3,
        }

    return fixed(
        example_channel={
            "b": 2,
            "t_q": 1,
            "past": 6,
            "per_seq_kv_lens": None,
            "channel_lead": [0, 4],
            "flash_on_cuda": False,
        },
        example_all_zero_lead={
            "b": 2,
            "t_q": 1,
            "past": 6,
            "per_seq_kv_lens": None,
            "channel_lead": [0, 0],
            "flash_on_cuda": False,
        },
        example_per_seq_lens_at_decode={
            "b": 2,
            "t_q": 1,
            "past": 6,
            "per_seq_kv_lens": [6, 3],
            "channel_lead": None,
            "flash_on_cuda": False,
        },
        example_flash_placeholder={
            "b": 1,
            "t_q": 3,
            "past": 4,
            "per_seq_kv_lens": None,
            "channel_lead": None,
            "flash_on_cuda": True,
        },
    ) + generated(n, make)


def _causal_matrix(_b, i):
    return {
        "mask": masks.make_causal_mask_matrix(
            i["b"], i["t_q"], i["past"], i["per_seq_kv_lens"], i["channel_lead"], i["flash_on_cuda"]
        )
    }


def _caller_cases(rng, n):
    def case(t_q, t_k_full, raw_base, t_k, t_c, caller_shape):
        inp = {
            "t_q": t_q,
            "t_k_full": t_k_full,
            "raw_base": raw_base,
            "t_k": t_k,
            "t_c": t_c,
            "has_caller": caller_shape is not None,
        }
        keep = rng.random((1, 1, t_q, t_k + t_c)) < 0.8
        inp["local"] = np.where(keep, 0.0, -np.inf)
        if caller_shape is not None:
            inp["caller"] = np.where(rng.random(caller_shape) < 0.8, 0.0, -np.inf)
        return inp

    def make(shape, i):
        t_q, t_c = int(rng.integers(1, 3)), 2 * (i % 2)
        width = 10 + t_c if rng.random() < 0.5 else 10
        shapes = [None, (1, 1), (t_q, width), (1, 1, t_q, width), (1, 1, 1, width)]
        return case(t_q, 10, 4, 6, t_c, shapes[i % len(shapes)])

    return fixed(
        example_no_caller=case(2, 10, 4, 6, 2, None),
        example_flash_placeholder=case(2, 10, 4, 6, 2, (1, 1)),
        example_raw_columns_sliced_and_compressed_padded=case(2, 10, 4, 6, 2, (2, 10)),
        example_callers_compressed_columns_kept=case(2, 10, 4, 6, 2, (1, 1, 2, 12)),
        example_one_query_row_broadcast=case(2, 10, 4, 6, 2, (1, 1, 1, 12)),
        refusal_rank_3=case(2, 10, 4, 6, 2, (1, 2, 10)),
        refusal_query_axis=case(2, 10, 4, 6, 2, (3, 10)),
        refusal_key_axis=case(2, 10, 4, 6, 2, (2, 11)),
    ) + generated(n, make)


def _caller(_b, i):
    caller = i.get("caller")
    return {
        "mask": masks.compose_caller_mask(
            i["local"], caller, i["t_q"], i["t_k_full"], i["raw_base"], i["t_k"], i["t_c"]
        )
    }


# ------------------------------------------------------------------------------ rope


def _positions_cases(rng, n):
    def make(shape, i):
        off = lengths(rng, shape, 0, 600) or [int(rng.integers(0, 600))]
        return {
            "offsets": off if i % 5 != 4 else off[:1],
            "b": len(off),
            "t": int(rng.integers(0, 5)),
        }

    return fixed(
        example_decode_6_4_2={"offsets": [6, 4, 2], "b": 3, "t": 1},
        example_verify_10_7_w3={"offsets": [10, 7], "b": 2, "t": 3},
        example_prefill_at_0={"offsets": [0], "b": 1, "t": 5},
    ) + generated(n, make)


def _rope_cases(rng, n):
    def make(shape, i):
        off = lengths(rng, shape, 0, 600) or [int(rng.integers(0, 600))]
        b = len(off)
        return {
            "x": random_array(rng, b, 2, int(rng.integers(1, 4)), 8),
            "offsets": off if i % 5 != 4 else off[:1],
            "rope_dims": int(rng.choice([2, 4, 8])),
            "theta": 10000.0,
            "inverse": i % 3 == 2,
        }

    return fixed(
        example_decode_6_4_2={
            "x": random_array(rng, 3, 2, 1, 8),
            "offsets": [6, 4, 2],
            "rope_dims": 4,
            "theta": 10000.0,
            "inverse": False,
        },
        example_verify_10_7_w3={
            "x": random_array(rng, 2, 2, 3, 8),
            "offsets": [10, 7],
            "rope_dims": 8,
            "theta": 10000.0,
            "inverse": False,
        },
        example_inverse={
            "x": random_array(rng, 2, 1, 2, 4),
            "offsets": [3, 9],
            "rope_dims": 4,
            "theta": 10000.0,
            "inverse": True,
        },
    ) + generated(n, make)


def _rope(b, i):
    return {
        "y": b.to_numpy(
            b.apply_rope(i["x"], i["offsets"], i["rope_dims"], i["theta"], i["inverse"])
        )
    }


def _comp_positions_cases(rng, n):
    return fixed(
        example_ratio_4={"t_c": 3, "ratio": 4}, example_none={"t_c": 0, "ratio": 128}
    ) + generated(
        n, lambda shape, i: {"t_c": int(rng.integers(0, 6)), "ratio": int(rng.choice([4, 128]))}
    )


# ------------------------------------------------------------------------------ attention


def _attention_inputs(
    rng,
    rows: list[int] | None,
    b: int,
    t_q: int,
    t_k: int,
    ratio: int,
    window: int,
    raw_prefix: int = 0,
    sinks: bool = True,
) -> dict:
    t_c = 0 if ratio == 0 else (raw_prefix + t_k) // ratio
    inp = {
        "q": random_array(rng, b, 2, t_q, 4),
        "k": random_array(rng, b, 1, t_k, 4),
        "v": random_array(rng, b, 1, t_k, 4),
        "compress_ratio": ratio,
        "sliding_window": window,
        "raw_prefix": raw_prefix,
        "row_q0": rows,
        "has_compressed_kv": ratio > 0,
        "has_sinks": sinks,
    }
    if ratio > 0:
        inp["compressed_kv"] = random_array(rng, b, 1, t_c, 4)
    if sinks:
        inp["sinks"] = random_array(rng, 2)
    return inp


def _attention_cases(rng, n):
    def make(shape, i):
        rows = lengths(rng, shape, 0, 12, max_rows=3)
        b = max(len(rows), 1)
        t_q = int(rng.integers(1, 4))
        t_k = max(rows, default=int(rng.integers(0, 12))) + t_q
        return _attention_inputs(
            rng,
            rows if i % 7 != 6 else None,
            b,
            t_q,
            t_k,
            int(rng.choice([0, 4])),
            int(rng.integers(1, 10)),
            sinks=i % 2 == 0,
        )

    return fixed(
        example_csa_rows_6_4_2=_attention_inputs(rng, [6, 4, 2], 3, 1, 7, 4, 4),
        example_verify_rows_10_7=_attention_inputs(rng, [10, 7], 2, 3, 13, 4, 8),
        example_standard_layer=_attention_inputs(rng, [5, 3], 2, 1, 6, 0, 128, sinks=False),
        example_raw_prefix=_attention_inputs(rng, None, 1, 1, 6, 4, 4, raw_prefix=4),
        refusal_more_queries_than_keys=_attention_inputs(rng, None, 1, 5, 3, 0, 4),
        refusal_raw_prefix_past_window_base=_attention_inputs(
            rng, None, 1, 1, 3, 0, 4, raw_prefix=6
        ),
        refusal_ragged_width=_attention_inputs(rng, [6, 4], 3, 1, 7, 4, 4),
    ) + generated(n, make)


def _attention(b, i):
    cfg = Dsv4AttentionConfig(
        i["compress_ratio"], i["sliding_window"], i["raw_prefix"], i["row_q0"]
    )
    out = b.dsv4_attention(i["q"], i["k"], i["v"], i.get("compressed_kv"), cfg, i.get("sinks"))
    return {"out": b.to_numpy(out)}


def tensor_functions() -> list[Fn]:
    """Every tensor vector function, in manifest order."""
    m = masks
    return [
        Fn(
            "masks",
            "raw_keep_span",
            "M §3",
            "reference.masks.raw_keep_span",
            lambda _b, i: dict(
                zip(
                    ("raw_base", "keep"),
                    m.raw_keep_span(i["t_q"], i["window"], i["t_k_full"]),
                    strict=True,
                )
            ),
            _keep_span_cases,
        ),
        Fn(
            "masks",
            "union_mask",
            "M §5",
            "reference.masks.ragged_union_mask",
            _union_mask,
            _union_mask_cases,
        ),
        Fn(
            "masks",
            "make_left_padded_causal_mask",
            "M §9.2",
            "reference.masks.make_left_padded_causal_mask",
            plain(m.make_left_padded_causal_mask, "mask", "b", "t_q", "past", "live"),
            _left_padded_cases,
        ),
        Fn(
            "masks",
            "make_causal_mask_matrix",
            "M §9.3",
            "reference.masks.make_causal_mask_matrix",
            _causal_matrix,
            _causal_matrix_cases,
        ),
        Fn(
            "masks",
            "graph_mode_length_mask",
            "M §8",
            "reference.masks.graph_mode_length_mask",
            plain(m.graph_mode_length_mask, "mask", "positions", "cap"),
            _graph_mask_cases,
        ),
        Fn(
            "masks",
            "compose_caller_mask",
            "M §6",
            "reference.masks.compose_caller_mask",
            _caller,
            _caller_cases,
        ),
        Fn(
            "masks",
            "sdpa_sliding_window",
            "M §7",
            "reference.masks.sdpa_sliding_window",
            plain(m.sdpa_sliding_window, "window", "ratio", "w"),
            lambda rng, n: [
                (f"domain-ratio-{r}-w-{w}", {"ratio": r, "w": w})
                for r in (0, 1, 4, 128)
                for w in (0, 128)
            ],
        ),
        Fn(
            "masks",
            "mask_must_be_applied_as_bias",
            "M §10",
            "reference.masks.mask_must_be_applied_as_bias",
            plain(m.mask_must_be_applied_as_bias, "bias", "dims"),
            lambda rng, n: [
                (f"domain-dims-{'x'.join(map(str, d)) if d is not None else 'none'}", {"dims": d})
                for d in (None, [1, 1], [4, 8], [2, 1, 4], [2, 1, 4, 8], [1, 2, 1, 4, 8])
            ],
        ),
        Fn(
            "rope",
            "rope_positions",
            "M §11",
            "reference.rope.apply_rope",
            lambda b, i: {
                "positions": np.asarray(
                    b.rope_positions(i["offsets"], i["b"], i["t"]), dtype=np.int64
                )
            },
            _positions_cases,
        ),
        Fn("rope", "apply_rope", "M §11", "reference.rope.apply_rope", _rope, _rope_cases),
        Fn(
            "rope",
            "compressed_key_positions",
            "M §11",
            "reference.rope.compressed_key_positions",
            plain(rope.compressed_key_positions, "positions", "t_c", "ratio"),
            _comp_positions_cases,
        ),
        Fn(
            "attention",
            "dsv4_attention",
            "M §4",
            "reference.attention.dsv4_attention",
            _attention,
            _attention_cases,
        ),
    ]
