"""torch.compile(flex_attention) on a CPU fails to build its C++ kernel once the shapes
change from call to call (the recompile with dynamic sizes), though each shape compiles on
its own.

Found by `raggedspec check-kernel --layout padded torch:flex --dtype float32` (before that
target compiled each batch afresh) and by transformers' flex_attention implementation in
`raggedspec check-model --impl flex_attention` (torch 2.13.0+cpu, gcc 12.2): every verify
batch has new sizes. Expected: the
compiled output equals eager flex_attention's. Seen: the first shape runs, and the call that
recompiles for new sizes (the second or the third, over our runs) raises
torch._inductor.exc.InductorError: CppCompileError (the generated kernel uses undeclared
names such as `cur_qSplitSize8`, `cur_kvSplitSize0`). Each shape compiled first in a fresh
process runs.

    python examples/third_party/torch_flex_cpu_compile_error.py
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
compiled = torch.compile(flex_attention)
for batch, queries, keys in [(1, 1, 1), (2, 1, 1), (2, 3, 5)]:
    q = torch.randn(batch, 1, queries, 16)
    k, v = torch.randn(batch, 1, keys, 16), torch.randn(batch, 1, keys, 16)
    keep = torch.ones(batch, queries, keys, dtype=torch.bool)

    def mask_mod(b, h, qi, kj, keep=keep):
        return keep[b, qi, kj]

    mask = create_block_mask(mask_mod, batch, None, queries, keys, device="cpu")
    want = flex_attention(q, k, v, block_mask=mask)
    got = compiled(q, k, v, block_mask=mask)  # raises CppCompileError once sizes change
    print((batch, queries, keys), "compiled equals eager:", torch.allclose(got, want, atol=1e-5))
