"""A rank that stops making progress without dying: noticed, named, and the job ended.

The training loop and every layer's forward mark progress (`beat`; a backward pass lies between
two forwards, and a backward hook would wrap the inputs FSDP2, DTensor and pipelining see). A thread checks
the mark once a second; after `timeout_s` without one it writes this rank's cause to the
launcher's errors file and ends the process, which makes torchrun end the job. Every rank of a
hung job stops progressing, the hung one and the peers waiting for it in a collective; the
thread tells them apart by the main thread's stack: a rank stopped inside torch.distributed is
waiting for a peer (a consequence, which `runtime.launch.failure_message` ranks after causes),
any other rank is hung where its stack says. Paused while a checkpoint is written. Before the
layers exist, `joining` limits the start-up the same way: peers that a rank stopped before it
joined the process group would otherwise wait for torch's own rendezvous timeout.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from costmodel.inputs import write_text_atomic

_last = [time.monotonic()]
_paused = [0]
_step = [0]   # the step this rank is in (1-based; 0: before the first), for the causes it reports
_label = [""]   # that step as the progress lines name it (step_label)


def step_label(step: int, warmup: int, steps: int) -> str:
    """Step `step` (0-based, warm-up first) as a run's progress lines and errors name it."""
    return f"warm-up {step + 1}/{warmup}" if step < warmup else f"step {step - warmup + 1}/{steps}"


def at_step(step: int, label: str = "") -> None:
    """The training loop entered `step` (1-based), named `label` (step_label) in its causes."""
    _step[0], _label[0] = step, label or f"step {step}"


def current_step() -> int:
    return _step[0]


def with_step(cause: str) -> str:
    """A rank's cause line as the launcher reads it: `step 3/8: cause` (or `warm-up 1/2: cause`)
    once training has begun."""
    return f"{_label[0]}: {cause}" if _step[0] else cause


def beat(*_args, **_kwargs) -> None:
    """Progress (usable as a module hook)."""
    _last[0] = time.monotonic()


@contextmanager
def paused():
    """Long work that marks no progress on purpose (a checkpoint write)."""
    _paused[0] += 1
    try:
        yield
    finally:
        _paused[0] -= 1
        beat()


def watch(modules, errors_file: Path, timeout_s: float) -> None:
    """Mark progress in every layer's forward and start the checking thread."""
    for mod in modules:
        for layer in getattr(mod, "layers", {}).values():
            layer.register_forward_pre_hook(beat)
    main = threading.main_thread().ident
    beat()
    threading.Thread(target=_check, args=(main, errors_file, timeout_s), daemon=True, name="planner-watchdog").start()


@contextmanager
def joining(errors_file: Path, timeout_s: float):
    """Start-up, before any layer marks progress: a rank whose peers have not all joined the
    process group within `timeout_s` (0: no limit) says so and ends the process. Worded as a
    lost-peer consequence: the rank that never joined (stopped or stuck before it could, so it
    writes nothing) is the cause, which runtime.launch names from torchrun's summary."""
    joined = threading.Event()
    if timeout_s > 0:
        threading.Thread(target=_wait_to_join, args=(joined, errors_file, timeout_s), daemon=True,
                         name="planner-join-watchdog").start()
    try:
        yield
    finally:
        joined.set()


def _wait_to_join(joined: threading.Event, errors_file: Path, timeout_s: float) -> None:
    if joined.wait(timeout_s):
        return
    write_text_atomic(errors_file, f"RankHung: waiting for a peer to join for {timeout_s:.0f} s (Timeout): the "
                                   "process group did not form\n")
    os._exit(4)


def _check(main: int, errors_file: Path, timeout_s: float) -> None:
    while True:
        time.sleep(1.0)
        idle = time.monotonic() - _last[0]
        if _paused[0] or idle < timeout_s:
            continue
        frames = traceback.extract_stack(sys._current_frames()[main])
        waiting = any("torch/distributed" in f.filename.replace(os.sep, "/") for f in frames)
        where = next((f for f in reversed(frames) if "/runtime/" in f.filename.replace(os.sep, "/")), frames[-1])
        if waiting:   # worded as a lost-peer consequence (runtime.launch.PEER_LOST, HUNG_WAITING)
            cause = f"RankHung: waiting for a peer for {idle:.0f} s (Timeout) in torch.distributed"
        else:
            cause = (f"RankHung: no progress for {idle:.0f} s (--hang-timeout) at "
                     f"{Path(where.filename).name}:{where.lineno} in {where.name}")
        write_text_atomic(errors_file, with_step(cause) + "\n\n" + "".join(traceback.format_list(frames)))
        os._exit(4)
