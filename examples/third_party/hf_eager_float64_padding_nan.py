"""transformers eager attention in float64: a left-padded row's padding queries give NaN, the
NaN reaches the KV cache, and the row's later live queries read it (NaN x 0 is NaN).

Found by `raggedspec check-model --arch llama --impl eager --dtype float64` (transformers
5.24.0, torch 2.13.0+cpu); every architecture in the eager float64 column of docs/third-party.md.
The eager mask uses torch.finfo(float64).min for a masked key; the scores are then
soft-maxed in float32 (`softmax(..., dtype=torch.float32)`), where that value is -inf, so a
padding query that attends no key gets NaN. sdpa, and eager in float32, give finite values.

    python examples/third_party/hf_eager_float64_padding_nan.py
"""

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     initializer_range=0.2)
for impl in ("eager", "sdpa"):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.config._attn_implementation = impl
    prompt_a, prompt_b = [5, 6, 7], [8]
    ids = torch.tensor([prompt_a, [0, 0] + prompt_b])  # row 1 left-padded by 2
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    pos = torch.tensor([[0, 1, 2], [0, 0, 0]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                    cache=DynamicCache(config=config))
        step = model(input_ids=torch.tensor([[9], [9]]),
                     attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
                     position_ids=torch.tensor([[3], [1]]), cache=out.cache)
        alone = model(input_ids=torch.tensor([prompt_b + [9]])).logits[0, -1]
    k = out.cache.layers[1].keys[1]
    print(f"{impl}: padding column keys finite: {bool(torch.isfinite(k).all())}; row 1's next "
          f"token logits finite: {bool(torch.isfinite(step.logits[1, -1]).all())}; equal to the "
          f"row alone: {torch.allclose(step.logits[1, -1], alone, atol=1e-12)}")
