"""Mutation testing for raggedspec (docs/mutation.md).

`catalogue.toml` names one semantic mutation per bug class, read and run by `catalogue.py` in a
private copy of the package (caught only when a test fails); `mutmut_gate.py` runs mutmut itself
over a scope and gates each module on its score; `runner.py` is `raggedspec mutation`, one gate
over both. Nothing here writes into the checkout's source files or keeps records between runs
(mutmut keeps its own, in `mutants/`).
"""
