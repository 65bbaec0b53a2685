"""`raggedspec bench`: ragged verify attention, the strategies side by side against the live-KV
bound, and the end-to-end simulator run (docs/bench.md, results in docs/benchmarks.md).

`strategies` holds the case and the ways of computing it, `runner` the checked-then-timed run
and the entry points, `report` the tables and the plot rendered from the result JSON.
"""
