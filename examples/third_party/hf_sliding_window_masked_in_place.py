"""transformers' sliding window counts cache columns, not positions: a rejected draft left in
the cache and masked out (attention mask 0) still takes a place in the window, and the
sliding-window cache layer keeps the last `sliding_window - 1` columns, so a key the window
needs is gone.

Found by `raggedspec check-model --arch mistral --family mask` (transformers 5.24.0, torch
2.13.0+cpu): mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, any implementation. One row,
window 2: the cache holds t0 (position 0), t1 (position 1) and a rejected draft (masked);
the next step feeds t2 at position 2 and a draft at position 3. The query at position 2 must
see positions 1 and 2 (kp > qp - window); transformers' mask is built over columns, where
the masked draft sits between them.

    python examples/third_party/hf_sliding_window_masked_in_place.py
"""

import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

config = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       initializer_range=0.2, sliding_window=2)
torch.manual_seed(0)
model = MistralForCausalLM(config).to(torch.float64).eval()
model.config._attn_implementation = "sdpa"
t0, t1, draft, t2, d2 = 5, 6, 7, 8, 9
cache = DynamicCache(config=config)
with torch.no_grad():
    model(input_ids=torch.tensor([[t0]]), position_ids=torch.tensor([[0]]), cache=cache)
    model(input_ids=torch.tensor([[t1, draft]]), attention_mask=torch.tensor([[1, 1, 1]]),
          position_ids=torch.tensor([[1, 2]]), cache=cache)
    # the draft at column 2 was rejected: masked in place; t2 takes position 2
    step = model(input_ids=torch.tensor([[t2, d2]]),
                 attention_mask=torch.tensor([[1, 1, 0, 1, 1]]),
                 position_ids=torch.tensor([[2, 3]]), cache=cache).logits[0]
    alone = model(input_ids=torch.tensor([[t0, t1, t2, d2]])).logits[0, 2:]
print(f"largest logit difference from the row run alone: {(step - alone).abs().max():.3g}")
