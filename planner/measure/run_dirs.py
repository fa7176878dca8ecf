"""`planner run` directories as calibration reads them: each a plan and its measured step time,
checked (complete, not oversubscribed, measured on the profile's kind of device, its plan valid
and the one measured), and repeats of one plan merged."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from costmodel.check import check_structure
from costmodel.estimate import Estimate, estimate
from costmodel.frameworks import RUNTIME
from costmodel.hardware import DeviceProfile, run_by
from costmodel.inputs import UserError, read_json_object
from costmodel.measured import MeasuredRun
from costmodel.plan import PlanFile
from runtime.measure import priced_as_run


@dataclass(frozen=True)
class Run:
    """A plan and its measured step time (`measured`: the whole record, for `planner run`'s runs;
    None for the profiler's probes, which time steps only)."""
    path: Path
    pf: PlanFile
    measured_step_s: float
    measured: MeasuredRun | None = None

    @property
    def compiled(self) -> bool:
        """Whether its layers ran under `planner run --compile` (a probe's never do)."""
        return self.measured is not None and self.measured.compiled


def load_run(path: Path, device: Path | None = None, kind: str | None = None) -> Run:
    """A `planner run` directory. `device`: the profile to read its plan under instead of the one
    its plan.json names (runs measured on another machine name a path of that machine); `kind`:
    the kind of device (gpu, cpu) its timings must come from to be read under it."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run directory")
    if not path.is_dir():   # a run's own file (measured.json, plan.json) given for its directory
        raise UserError(f"{path} is a file; give the run's directory (`planner run --out`), {path.parent}")
    for name in ("plan.json", "measured.json"):
        if not (path / name).exists():
            raise UserError(f"{path} is not a run directory of `planner run` (no {name})")
    measured = MeasuredRun.load(path / "measured.json")
    if not measured.complete:
        raise UserError(f"{path}: the run was interrupted after {measured.steps} step(s) (measured.json is "
                         "marked incomplete); calibrate on complete runs (run it again)")
    if measured.oversubscribed:
        raise UserError(f"{path}: its {measured.world_size} ranks shared this machine's cores (more rank threads "
                         "than cores), which no profile prices; calibrate on runs with at most one thread per core")
    ran_on = "cpu" if measured.device == "cpu" else "gpu"   # measured.json: "cpu" or the GPU's name
    if kind is not None and ran_on != kind:   # timings of one kind of device say nothing of another's
        raise UserError(f"{path} ran on {measured.cluster} (a {ran_on}); it cannot calibrate {device} (a {kind}): "
                        "calibrate a profile with runs measured on that kind of device")
    data = read_json_object(path / "plan.json", "plan file")
    if device is not None and isinstance(data.get("cluster"), dict):
        data["cluster"]["device"] = str(device)
    pf = PlanFile.from_dict(data, str(path / "plan.json"))
    if problems := check_structure(pf.model, pf.train, pf.cluster, pf.plan):
        raise UserError(f"{path / 'plan.json'} is not a valid plan: " + "; ".join(problems))
    if measured.plan != pf.plan.to_dict():   # a plan.json edited, or copied from another run
        raise UserError(f"{path}: measured.json was measured for another plan than its plan.json")
    return Run(path=path, pf=pf, measured_step_s=measured.step_time_s, measured=measured)


def merge_repeats(runs: list[Run]) -> list[Run]:
    """One run per plan: runs of the same plan file (model, training, plan and cluster alike)
    become one whose step time is their geometric mean (the fit's errors are logarithms). The fit
    weighs plans, not repetitions: unmerged, a plan run N times would count N times against the
    others, and N runs of every plan would weaken the prior N-fold (PRIOR_WEIGHT was chosen on one
    run per plan)."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(json.dumps([r.pf.to_dict(), r.compiled], sort_keys=True), []).append(r)
    return [g[0] if len(g) == 1 else
            replace(g[0], measured_step_s=math.exp(statistics.fmean(math.log(r.measured_step_s) for r in g)))
            for g in groups.values()]


def predict_with(run: Run, device: DeviceProfile) -> Estimate:
    """The run's estimate on `device` (a profile as read, as the included runtime uses it),
    priced as it ran: under its plan's framework, as `planner run` compared it (the vendor
    attention that framework calls, costmodel.hardware.run_by), compiled or eager."""
    cluster = replace(run.pf.cluster, device=device)
    if not cluster.groups:
        cluster = run_by(replace(cluster, framework=RUNTIME), run.pf.cluster.framework)
    pf = priced_as_run(replace(run.pf, cluster=cluster), run.compiled)
    return estimate(pf.model, pf.train, pf.cluster, pf.plan)
