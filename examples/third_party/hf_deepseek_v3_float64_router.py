"""deepseek_v3 in float64: a row's logits in a left-padded batch differ from the row run alone
by about 1e-7 (other float64 models: 1e-15). The MoE router computes its logits in float32
(`F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))`) whatever
the model's dtype; we read that as the cause. A precision difference, not a rule of the
spec: positions, masks and the cache agree.

Found by `raggedspec check-model --arch deepseek_v3 --dtype float64` (transformers 5.24.0,
torch 2.13.0+cpu).

    python examples/third_party/hf_deepseek_v3_float64_router.py
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

config = AutoConfig.for_model(
    "deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=8, initializer_range=0.2,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, experts_implementation="eager")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
model = model.to(torch.float64).eval()
rows = torch.tensor([[90, 60, 65, 86], [0, 0, 0, 74], [0, 0, 22, 6]])  # left-padded prefill
mask = (rows != 0).long()
with torch.no_grad():
    batch = model(input_ids=rows, attention_mask=mask,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    alone = model(input_ids=rows[:1]).logits[0]
print(f"row 0 in the batch vs alone, float64: {(batch[0] - alone).abs().max():.3g}")
