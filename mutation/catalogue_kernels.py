"""Catalogue entries for the check-kernel adapters (raggedspec/kernel_adapters.py).

Each entry plants in a built-in adapter one of the layout bugs that ragged speculative
decoding exposes; `conformance/test_check_kernel.py` must then fail (its built-in adapter
test runs the mutated adapter through `check-kernel`'s generated batches). Rows are
`(name, file, old, new, spec, tests)` and `mutation/catalogue.py` turns them into entries.
"""

from __future__ import annotations

ADAPTERS, CHECK = "raggedspec/kernel_adapters.py", "conformance/test_check_kernel.py"

KERNEL_MUTANTS: list[tuple[str, str, str, str, str, tuple[str, ...]]] = [
    (
        "kernel_adapters visible: causal aligned top-left (query i sees keys <= i)",
        ADAPTERS,
        "diag = i + k_len - q_len",
        "diag = i",
        "kernels: bottom-right causal",
        (CHECK,),
    ),
    (
        "kernel_adapters visible: the window starts from the row's last query",
        ADAPTERS,
        "ok &= j >= diag - left",
        "ok &= j >= diag[-1:] - left",
        "kernels: window per query",
        (CHECK,),
    ),
    (
        "kernel_adapters sdpa_kvcache: cache_leftpad ignored",
        ADAPTERS,
        "start = 0 if cache_leftpad is None else int(cache_leftpad[b])",
        "start = 0",
        "kernels: cache_leftpad",
        (CHECK,),
    ),
    (
        "kernel_adapters sdpa_paged: a row's pages read one kv_indices entry late",
        ADAPTERS,
        "pages = kv_indices[kvp[b] : kvp[b + 1]].long()",
        "pages = kv_indices[kvp[b] + 1 : kvp[b + 1] + 1].long()",
        "kernels: page table",
        (CHECK,),
    ),
    (
        "kernel_adapters kv_head_index: GQA head h % Hk instead of h // (Hq / Hk)",
        ADAPTERS,
        "torch.arange(hq, device=device) // (hq // hk)",
        "torch.arange(hq, device=device) % hk",
        "kernels: GQA head",
        (CHECK,),
    ),
]
