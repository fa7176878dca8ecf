"""How far the cost model's step times are from measurements it was not fitted on.

`MODEL_ERROR_BAND` is the leave-one-source-out MAPE of step time over the published runs
(profiles/runs/published_runs.csv): each source's runs predicted by a fit on the other sources.
`python benchmarks/fidelity.py` prints it (its "leave one source out" line): 5.1 % over the
table's 210 runs from 15 sources, each shipped efficiency inside its published range and none at
a bound, the whole table's fit too (`planner validate` names any that is, fidelity.py any the
whole table's fit pins); docs/results.md says whether the two still agree.
Plans whose predicted step times differ by less than this are not told apart by the evidence, so
the search treats them as equivalent and prefers the more robust one (planner.search).
"""
MODEL_ERROR_BAND = 0.051

# The largest |error| of peak memory predicted against measured over the stored single-H100 runs
# of our runtime (docs/results.md, `python3 benchmarks/gpu_check.py --replay ...`: MAPE 0.4 %,
# max 4.8 %): memory margins that differ by less than this share of the device are not told
# apart by the evidence, and a plan whose margin is below it may not fit (planner.ranking).
MEMORY_ERROR_BAND = 0.048

PUBLISHED = "leave-one-source-out on published runs"


def error_band(cluster) -> tuple[float, str]:
    """(the step-time error a search or a prediction on `cluster` quotes, where it comes from):
    MODEL_ERROR_BAND, or on a profile fitted to its own probe steps (`planner profile` of a
    machine) the larger of it and those steps' error after the fit, which the published runs,
    measured on other hardware, do not bound."""
    devices = [g.device for g in cluster.groups] or [cluster.device]
    probes = max(d.probe_error for d in devices)
    if probes > MODEL_ERROR_BAND:
        return probes, "this machine's profile: its probe steps after the fit"
    return MODEL_ERROR_BAND, PUBLISHED
