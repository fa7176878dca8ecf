import subprocess
import sys


def test_pure_packages_never_import_torch():
    """DESIGN: costmodel, planner and reports stay torch-free (fast CLI, no GPU stack needed)."""
    code = ("import sys, costmodel.estimate, costmodel.check, planner.cli, planner.measure.validate, planner.measure.probes, "
            "planner.measure.machine_speed, reports.tables; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
