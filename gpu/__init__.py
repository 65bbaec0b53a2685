"""raggedspec's torch port of the tensor-side rules (`reference/` is the NumPy oracle).

Module layout mirrors `reference/` so the two read side by side:

| port            | reference              | what                                              |
|-----------------|------------------------|---------------------------------------------------|
| gpu.masks       | reference.masks        | validity, ragged union mask, caller fold, masker  |
| gpu.rope        | reference.rope         | per-row RoPE by one gathered cos/sin table        |
| gpu.attention   | reference.attention    | sink softmax attention, `dsv4_attention`          |
| gpu.dispatch    | reference.dispatch     | uniform-vs-ragged predicates, draft groups        |
| gpu.step        | reference.step         | window, verify (first mismatch), clamp, advance   |
| gpu.cache       | reference.cache        | `RaggedKv`: the in-place per-row KV layout         |
| gpu.align       | reference.align        | front alignment as per-row offsets; materialize    |
| gpu.xs_rolling  | reference.xs_rolling   | compressor history as a per-row ring buffer        |
| gpu.model       | reference.model        | the tiny model's forward on the in-place layout    |
| gpu.draft       | reference.draft        | the batched draft chain on one shared draft pool   |

Conventions: every function takes `device` / `dtype` where it creates tensors; length
vectors are int64 tensors; masks are additive (0 / -inf) in the requested float dtype.
Refusals raise the same `reference.errors` classes with messages naming the same values.
Predicates that pick the scalar path return `None` for a uniform batch exactly as the
reference does (that decision is a host-side branch, so it reads the vector once).
"""
