"""transformers' DynamicSlidingWindowLayer with sliding_window=1 keeps every column: it
slices `[-sliding_window + 1:]`, which is `[0:]`, so the mask (sized for a window) and the
keys disagree and the next cached forward raises.

Found by `raggedspec check-model --arch mistral` with windows drawn from 1 (transformers
5.24.0, torch 2.13.0+cpu). A window of 1 (each query sees itself) is legal in the spec
(masks §4 step 5: kp > qp - window) and in transformers' own mask functions.

    python examples/third_party/hf_sliding_window_of_one.py
"""

import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

config = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=1)
torch.manual_seed(0)
model = MistralForCausalLM(config).eval()
model.config._attn_implementation = "sdpa"
cache = DynamicCache(config=config)
with torch.no_grad():
    model(input_ids=torch.tensor([[5, 6]]), cache=cache)
    print("keys kept by the window-1 layer:", cache.layers[0].keys.shape[2])
    model(input_ids=torch.tensor([[7, 8]]), cache=cache)  # raises: mask and keys disagree
