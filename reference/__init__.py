"""raggedspec reference: readable float64 NumPy rules of batched speculative decoding.

Every rule of `shared/spec/` is one function; `docs/rules.md` maps rule -> function -> test.
"""
