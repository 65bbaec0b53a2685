"""Mutation testing for raggedspec (issue 6; docs/mutation.md).

`mutation.catalogue` holds the named semantic mutants (one small, exact source substitution
each, with the spec row it comes from); `raggedspec.mutation.runner` applies them one at a time in a
temporary copy of the tree, runs mutmut over the dispatch and step-arithmetic code, gates on
the score and on `mutation/equivalent.toml`, and writes `docs/mutation.md`. Nothing here ever
writes into the checkout's source files.
"""
