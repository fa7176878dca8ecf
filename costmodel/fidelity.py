"""How far the cost model's step times are from measurements it was not fitted on.

`MODEL_ERROR_BAND` is the leave-one-source-out MAPE of step time over the published runs
(profiles/runs/published_runs.csv): each source's runs predicted by a fit on the other sources.
`python benchmarks/fidelity.py` prints it (its "leave one source out" line): 5.9 % over the
table's 77 runs from 8 sources. Plans whose predicted step times differ by less than this are not
told apart by the evidence, so the search treats them as equivalent and prefers the more robust
one (planner.search).
"""
MODEL_ERROR_BAND = 0.059
