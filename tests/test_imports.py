import subprocess
import sys


def test_pure_packages_never_import_torch():
    """DESIGN: costmodel, planner and reports stay torch-free (fast CLI, no GPU stack needed)."""
    code = ("import sys, costmodel.estimate, costmodel.check, planner.cli, planner.measure.validate, planner.measure.probes, "
            "planner.measure.machine_speed, reports.tables; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_command_line_imports_the_solver_only_to_solve():
    """OR-Tools' CP-SAT (and the pandas it imports) is most of the command line's start-up:
    the commands that solve no split (predict, report, export, --help) start without it."""
    code = ("import sys, planner.cli, planner.commands.predict, planner.commands.report; "
            "print(sorted(m for m in ('ortools', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
