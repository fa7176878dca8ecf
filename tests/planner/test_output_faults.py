"""Outputs under faults (planner.outputs): a full disk, an I/O error or a read-only file system is
one line naming the path, exit 1, with no file (whole or truncated) under the final name; a file
that appears after the check is refused, not clobbered; two writers race and one wins; a run
directory in use is refused; a closed or full standard output is one line or a quiet end."""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from costmodel.inputs import UserError
from planner import outputs, run_lock
from planner.cli import main

CPU = "1x2xxeon-amx"
TINY = ["--model", "debug-tiny", "--cluster", CPU]
FAULTS = [errno.ENOSPC, errno.EIO, errno.EROFS]


def _one_line(capsys, *phrases: str) -> str:
    err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines()
                    if not line.startswith(("search [", "sweep ", "writing the report")))
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "internal error" not in err, err
    for phrase in phrases:
        assert phrase in err, err
    return err


def _failing_fsync(code: int):
    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))
    return fsync


@pytest.mark.parametrize("code", FAULTS)
@pytest.mark.parametrize("argv, name", [
    (["predict", *TINY, "--out", "{d}/plan.json"], "plan.json"),
    (["search", *TINY, "--csv", "{d}/all.csv"], "all.csv"),
    (["export", "{plan}", "--to", "deepspeed", "--out", "{d}/ds.json"], "ds.json"),
    (["sweep", "--model", "debug-tiny", "--device", "xeon-amx", "--gpus-per-node", "2", "--nodes", "1", "--tokens",
      "1e9", "--plot", "{d}/curve.svg"], "curve.svg"),
])
def test_a_failed_write_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, plan_file, code, argv, name):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.setattr(outputs.os, "fsync", _failing_fsync(code))
    argv = [a.format(d=out_dir, plan=plan_file) for a in argv]
    assert main(argv) == 1
    _one_line(capsys, f"cannot write {out_dir / name}", os.strerror(code))
    assert list(out_dir.iterdir()) == []   # neither the file nor its temporary


@pytest.fixture()
def plan_file(tmp_path: Path, capsys) -> Path:
    plan = tmp_path / "plan.json"
    assert main(["predict", *TINY, "--pp", "2", "--out", str(plan)]) == 0
    capsys.readouterr()
    return plan


def test_a_file_that_appears_after_the_check_is_not_clobbered(tmp_path, capsys, monkeypatch):
    """search --out F checks F first and writes it after the search: a file another command wrote
    there meanwhile is refused in one line and left whole."""
    target = tmp_path / "plan.json"
    write_file = outputs.write_file

    def another_command_first(path, data, overwrite):
        if Path(path) == target:
            target.write_text("theirs\n")
        write_file(path, data, overwrite)
    monkeypatch.setattr(outputs, "write_file", another_command_first)
    assert main(["search", *TINY, "--out", str(target)]) == 2
    _one_line(capsys, f"{target} appeared while this command ran", "--overwrite")
    assert target.read_text() == "theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_two_writers_racing_on_one_name_one_wins(tmp_path):
    """The publish step itself: two threads released together, neither with --overwrite."""
    for attempt in range(5):
        target = tmp_path / f"race-{attempt}.json"
        barrier = threading.Barrier(2)
        results: dict[str, str] = {}

        def writer(tag: str) -> None:
            barrier.wait()
            try:
                outputs.write_file(target, tag * 1000, overwrite=False)
                results[tag] = "wrote"
            except outputs.Clobbered:
                results[tag] = "refused"
        threads = [threading.Thread(target=writer, args=(tag,)) for tag in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results.values()) == ["refused", "wrote"], results
        winner = next(tag for tag, r in results.items() if r == "wrote")
        assert target.read_text() == winner * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"race-{i}.json" for i in range(5)]


def test_a_profile_is_written_whole_or_refused(tmp_path, monkeypatch):
    """planner profile --out and calibrate --out write through planner.measure.profile_file."""
    from costmodel.hardware import profile_dir
    from planner.measure import profile_file
    doc = profile_file.parse((profile_dir() / "H100-SXM5-80GB.toml").read_text())
    target = tmp_path / "mine.toml"
    target.write_text("theirs")
    with pytest.raises(outputs.Clobbered):
        profile_file.write(target, doc, overwrite=False)
    assert target.read_text() == "theirs"
    monkeypatch.setattr(outputs.os, "fsync", _failing_fsync(errno.EIO))
    with pytest.raises(outputs.WriteFailed, match="Input/output error"):
        profile_file.write(target, doc, overwrite=True)
    assert target.read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["mine.toml"]


def test_overwrite_replaces_in_one_step(tmp_path):
    target = tmp_path / "x.csv"
    target.write_text("old")
    outputs.write_file(target, "new", overwrite=True)
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["x.csv"]


def _failing_savefig(monkeypatch, after: int, exc: OSError) -> None:
    """The `after`-th figure file is left half written, then the disk is full."""
    from matplotlib.figure import Figure
    savefig, calls = Figure.savefig, [0]

    def failing(self, fname, *args, **kwargs):
        calls[0] += 1
        if calls[0] >= after:
            Path(fname).write_bytes(b"<svg trunc")
            raise exc
        return savefig(self, fname, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", failing)


def test_a_report_that_fails_midway_leaves_no_truncated_file(tmp_path, capsys, monkeypatch, plan_file):
    report = tmp_path / "report"
    _failing_savefig(monkeypatch, 3, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert main(["report", str(plan_file), "--out", str(report)]) == 1
    _one_line(capsys, f"cannot write {report}", "No space left on device")
    assert not report.exists() or list(report.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"] + (["report"] if report.exists() else [])


def test_a_report_directory_removed_while_it_renders_is_one_line(tmp_path, capsys, monkeypatch, plan_file):
    import shutil
    report = tmp_path / "report"
    from matplotlib.figure import Figure

    def vanish(self, fname, *args, **kwargs):
        shutil.rmtree(Path(fname).parent)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(fname))
    monkeypatch.setattr(Figure, "savefig", vanish)
    assert main(["report", str(plan_file), "--out", str(report)]) == 1
    _one_line(capsys, f"cannot write {report}", "No such file or directory")


def test_a_report_another_command_published_first_is_left_whole(tmp_path, capsys, monkeypatch, plan_file):
    import reports.build
    report = tmp_path / "report"
    publish_dir = outputs._publish_dir

    def quick_report(inp, out_dir: Path, map_draws=None) -> list[str]:   # the files of a report, without drawing them
        for name in ("index.html", "index.md", "bubble.svg"):
            (out_dir / name).write_text("ours")
        return sorted(p.name for p in out_dir.iterdir())
    monkeypatch.setattr(reports.build, "write_report", quick_report)

    def another_report_first(tmp, final, overwrite, claims):
        final.mkdir(parents=True, exist_ok=True)
        (final / "index.html").write_text("theirs")
        publish_dir(tmp, final, overwrite, claims)
    monkeypatch.setattr(outputs, "_publish_dir", another_report_first)
    assert main(["report", str(plan_file), "--out", str(report)]) == 2
    _one_line(capsys, f"{report / 'index.html'} appeared while this command ran")
    assert [p.name for p in report.iterdir()] == ["index.html"] and (report / "index.html").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "report"]   # no staging left


def test_a_report_beside_files_of_its_figures_names_replaces_none(tmp_path, capsys, monkeypatch, plan_file):
    """A directory holding the user's bubble.svg: refused before anything is published, the file
    left; with --overwrite, replaced."""
    import reports.build

    def quick_report(inp, out_dir: Path, map_draws=None) -> list[str]:
        for name in ("index.html", "index.md", "bubble.svg"):
            (out_dir / name).write_text("ours")
        return sorted(p.name for p in out_dir.iterdir())
    monkeypatch.setattr(reports.build, "write_report", quick_report)
    report = tmp_path / "report"
    report.mkdir()
    (report / "bubble.svg").write_text("mine")
    assert main(["report", str(plan_file), "--out", str(report)]) == 2
    _one_line(capsys, f"{report} holds bubble.svg, which this report would replace; the report is not written")
    assert [p.name for p in report.iterdir()] == ["bubble.svg"] and (report / "bubble.svg").read_text() == "mine"
    assert main(["report", str(plan_file), "--out", str(report), "--overwrite"]) == 0
    assert (report / "bubble.svg").read_text() == "ours"


def test_a_file_this_command_wrote_is_not_a_user_s(tmp_path):
    """sweep --plot DIR/scaling.png --report DIR: the report may replace the picture the same
    command wrote a moment before; a file changed since is the user's again."""
    report = tmp_path / "sw"
    outputs.write_file(report / "scaling.png", b"plot", overwrite=False)
    with outputs.staged_dir(report, False, outputs.REPORT_FILES) as staging:
        (staging / "index.md").write_text("report")
        (staging / "scaling.png").write_bytes(b"report's")
    assert (report / "scaling.png").read_bytes() == b"report's"
    (report / "scaling.png").write_bytes(b"the user's")
    os.utime(report / "scaling.png", ns=(1, 1))
    with pytest.raises(UserError, match="holds scaling.png, which this report would replace"):
        with outputs.staged_dir(report, False, ()) as staging:
            (staging / "scaling.png").write_bytes(b"again")


def test_a_run_directory_in_use_is_refused(tmp_path, capsys, plan_file):
    """The first run is simulated by holding the lock here (flock: another open file, refused)."""
    run_dir = tmp_path / "run"
    with run_lock.run_dir_lock(run_dir):
        assert main(["run", str(plan_file), "--nproc", "2", "--out", str(run_dir)]) == 2
        _one_line(capsys, f"--out {run_dir} is in use by another run (pid {os.getpid()})")
    assert not run_dir.exists()   # made for the lock, left empty: removed with it


def test_a_full_disk_under_the_lock_is_one_line_before_the_run(tmp_path, monkeypatch):
    """The run directory's lock file holds the pid: on a full disk writing it is a WriteFailed
    naming the lock (it was an OSError shown as a bug), and the directory made for it is gone."""
    class FullDisk:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(run_lock, "os", FullDisk())
    with pytest.raises(outputs.WriteFailed, match=r"cannot write .*fresh/\.lock: No space left"):
        with run_lock.run_dir_lock(tmp_path / "fresh"):
            pytest.fail("the run started")
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_run_directory_removed_or_moved_while_held_is_said_not_recreated(tmp_path, how):
    """`planner run` asks check_held before it publishes measured.json: a directory removed or
    moved while the run held it was recreated with the record in it, apart from its run.log."""
    held = tmp_path / "run"
    with run_lock.run_dir_lock(held):
        run_lock.check_held(held)   # still the directory it locked
        if how == "removed":
            shutil.rmtree(held)
        else:
            held.rename(tmp_path / "elsewhere")
        held.mkdir()   # what a rank's write_text_atomic does next
        with pytest.raises(outputs.WriteFailed, match=r"cannot write .*run: it was removed or moved while the run held"):
            run_lock.check_held(held)
    run_lock.check_held(held)   # held by no run of this process: nothing to say


def test_a_directory_replaced_by_a_file_is_said_so(tmp_path):
    """The --out directory removed and a file put in its place while the command ran: one line
    naming that file, not mkdir's "File exists"."""
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(outputs.WriteFailed, match=r"p\.json: .*out is not a directory"):
        outputs.write_file(tmp_path / "out" / "deeper" / "p.json", "{}", overwrite=False)
    with pytest.raises(outputs.WriteFailed, match=r"out is not a directory"):
        with outputs.staged_dir(tmp_path / "out" / "report", overwrite=False):
            pass


def test_a_stale_lock_file_is_taken(tmp_path):
    """A run killed outright leaves its lock file; the kernel dropped its lock with the process."""
    (tmp_path / run_lock.LOCK_NAME).write_text("999999999\n")
    with run_lock.run_dir_lock(tmp_path):
        assert (tmp_path / run_lock.LOCK_NAME).read_text() == f"{os.getpid()}\n"


class _Broken(io.StringIO):
    def __init__(self, exc: OSError):
        super().__init__()
        self.exc = exc

    def write(self, text: str) -> int:
        raise self.exc


def test_a_full_standard_output_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Broken(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert main(["models"]) == 1
    _one_line(capsys, "planner models: error: cannot write standard output: No space left on device")


def test_a_closed_pipe_ends_quietly(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Broken(BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))))
    assert main(["devices", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_standard_output_on_a_full_device_or_closed(tmp_path):
    """Through the interpreter's own shutdown flush: one line, exit 1, never a traceback."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    for redirect in ("> /dev/full", ">&-"):
        done = subprocess.run(["bash", "-c", f"{sys.executable} -m planner models {redirect}"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, (redirect, done.stderr)
        assert len(done.stderr.splitlines()) == 1 and "cannot write standard output" in done.stderr, done.stderr


def test_standard_error_full_or_closed_is_exit_1_and_never_reaches_standard_output(tmp_path, capsys, monkeypatch):
    """Nothing can say it: the command's work stands, stdout holds its JSON alone (print to a
    closed stderr would write to stdout), and the exit is 1 instead of 0; a user's mistake keeps 2.
    Closed in-process (sys.stderr is None); full through the interpreter's own shutdown flush."""
    predict = ["predict", "--model", "debug-tiny", "--cluster", CPU, "--json", "--out"]   # `wrote F` goes to stderr
    monkeypatch.setattr(sys, "stderr", None)
    assert main([*predict, str(tmp_path / "closed.json")]) == 1
    assert json.loads(capsys.readouterr().out)["plan"] and (tmp_path / "closed.json").is_file()
    assert main(["predict", "--model", "nonesuch", "--cluster", CPU]) == 2 and capsys.readouterr().out == ""
    monkeypatch.undo()
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    argv = " ".join([sys.executable, "-m", "planner", *predict, str(tmp_path / "full.json")])
    done = subprocess.run(["bash", "-c", f"{argv} 2> /dev/full"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and json.loads(done.stdout)["plan"] and (tmp_path / "full.json").is_file(), done


def test_a_run_refused_before_it_starts_leaves_no_directory(tmp_path, capsys, plan_file):
    """`planner run` without --out makes runs/<model>-<time>: a run refused after it took the lock
    leaves no empty directory behind; a directory holding a run's files stays."""
    run_dir = tmp_path / "fresh"
    with run_lock.run_dir_lock(run_dir):
        assert (run_dir / run_lock.LOCK_NAME).exists()
    assert not run_dir.exists()
    kept = tmp_path / "kept"
    with run_lock.run_dir_lock(kept):
        (kept / "run.log").write_text("a run's file")
    assert [p.name for p in kept.iterdir()] == ["run.log"]


def test_json_outputs_are_strict_and_a_nan_is_a_bug(capsys, monkeypatch):
    """Every JSON a command writes goes through outputs.json_text: an infinity (a run that never
    ends) is null, a NaN is a bug naming its field, shown as a bug, and nothing reaches stdout."""
    text = outputs.json_text({"days": float("inf"), "rows": [1.5, {"gpu_hours": float("-inf")}]})
    assert json.loads(text) == {"days": None, "rows": [1.5, {"gpu_hours": None}]}
    with pytest.raises(outputs.NotFinite, match=r"\$\.rows\[1\]\.mfu is not a number"):
        outputs.json_text({"rows": [{}, {"mfu": float("nan")}]})
    import planner.commands.listing
    monkeypatch.setattr(planner.commands.listing, "total_params", lambda _m: float("nan"))
    assert main(["models", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "internal error, a bug in the planner" in captured.err and "$.models[0].params is not a number" in captured.err


# Every file our code writes other than through planner.outputs, and why it is not a command's
# output: a new writer fails test_every_writer_is_the_boundary_or_internal until it is one of these
# or goes through planner.outputs.
INTERNAL_WRITERS = {
    "costmodel/inputs.py": "write_text_atomic itself",
    "costmodel/plan.py": "PlanFile.save: tests' and scripts' plan.json (no command calls it)",
    "costmodel/measured.py": "MeasuredRun.save: tests' and scripts' measured.json (no command calls it)",
    "planner/cli.py": "a bug's traceback, into a new temporary file of its own (mkstemp)",
    "reports/build.py": "into the staging directory planner.outputs.staged_dir publishes",
    "reports/sweep_report.py": "into the staging directory planner.outputs.staged_dir publishes",
    "reports/style.py": "figures into the staging directory planner.outputs.staged_dir publishes",
    "reports/scaling.py": "a figure into memory (savefig to a buffer), published by planner.outputs.write_file",
    "runtime/worker.py": "raw.json, the restart marker and errors/rankN.txt: a rank's hand-off to the launcher "
                         "inside the run directory the run holds (planner.run_lock.run_dir_lock)",
    "runtime/watchdog.py": "errors/rankN.txt: a hung rank's diagnosis for the launcher, in the held run directory",
    "runtime/health.py": "partial.json of a diverged run, for the launcher, in the held run directory",
    "runtime/train.py": "partial.json after each step, for the launcher, in the held run directory",
    "runtime/checkpoint.py": "a checkpoint's files, in its partial directory, committed by one rename after its manifest",
    "runtime/manifest.py": "a checkpoint's manifest, in its partial directory before the commit",
    "runtime/fork.py": "a forked test harness's per-rank results, in its own temporary directory",
}
WRITES = (r"\.write_text\(|\.write_bytes\(|write_text_atomic\(|\.save\(|json\.dump\(|savefig\(|"
          r"open\([^)]*[\"'][wax]b?[\"']|os\.fdopen\([^)]*[\"'][wax]b?[\"']|os\.replace\(|shutil\.(copy|move)")


def test_every_writer_is_the_boundary_or_internal():
    """User-visible outputs are written by planner.outputs alone (strict JSON, whole or not at all,
    never over a file that appeared meanwhile); what writes files elsewhere is listed above with
    the reason it is internal."""
    import re
    root = Path(__file__).resolve().parents[2]
    writers = {str(path.relative_to(root)) for package in ("costmodel", "planner", "reports", "runtime")
               for path in (root / package).rglob("*.py") if re.search(WRITES, path.read_text())}
    assert writers - {"planner/outputs.py"} == set(INTERNAL_WRITERS)
