"""How far the cost model's step times are from measurements it was not fitted on.

`MODEL_ERROR_BAND` is the leave-one-source-out MAPE of step time over the published runs
(profiles/runs/published_runs.csv): each source's runs predicted by a fit on the other sources.
`python benchmarks/fidelity.py` prints it (its "leave one source out" line): 4.0 % over the
table's 269 runs from 18 sources, each shipped efficiency inside its published range and none at
a bound (`planner validate` names any that is; fidelity.py any the whole table's free fit pins:
none); docs/results.md says whether the two still agree.
Plans whose predicted step times differ by less than this are not told apart by the evidence, so
the search treats them as equivalent and prefers the more robust one (planner.search).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from costmodel.hardware import ClusterSpec

MODEL_ERROR_BAND = 0.040

# The largest |error| of peak memory predicted against measured over the stored single-H100 runs
# of our runtime (docs/results.md, `python3 benchmarks/gpu_check.py --replay ...`: MAPE 0.4 %,
# max 4.8 %): memory margins that differ by less than this share of the device are not told
# apart by the evidence, and a plan whose margin is below it may not fit (planner.ranking).
MEMORY_ERROR_BAND = 0.048

PUBLISHED = "leave-one-source-out on published runs"

# The longest sequences of the published runs the band comes from (profiles/runs/published_runs.csv),
# by the attention kernel that priced them: FlashAttention or torch's SDPA (composer's and torchtitan's
# runs reach 32k tokens), and the vendor's fused attention (Transformer Engine's cuDNN kernel, which
# Megatron-Core calls on Hopper and Blackwell: its runs reach 8k). Longer ones are kept apart
# (unmodelled_runs.csv: NeMo's long-sequence tables, torchtitan's CP runs, 16k tokens to 1M), priced
# fast in tokens/s (`python3 -m planner validate profiles/runs/unmodelled_runs.csv`): torchtitan's
# 26-45 % from 64k; with the vendor's kernel NeMo's B200 runs (25.04) 8-16 % from 16k and its H100
# runs (24.03, a container whose cuDNN rate is not known) 24-48 %. A prediction past its kernel's
# length says it is outside the band (long_sequence_note).
LONGEST_CALIBRATED_SEQ = 32768
LONGEST_CALIBRATED_VENDOR_SEQ = 8192


def runs_vendor_attention(cluster: ClusterSpec) -> bool:
    """Whether the cluster's framework prices attention with the vendor's fused kernel on its device
    (frameworks.attention_speedup: a speedup over FlashAttention-2 where the device has one)."""
    return cluster.framework.vendor_attention and cluster.device.efficiency.vendor_attention_speedup != 1.0


def long_sequence_note(seq_len: int, cluster: ClusterSpec) -> str | None:
    """What a prediction at `seq_len` on `cluster` says beside its quoted error: nothing within the
    lengths calibrated for its attention kernel, else that the band does not cover it (the JSON's
    `error_band_note`)."""
    if runs_vendor_attention(cluster):
        if seq_len <= LONGEST_CALIBRATED_VENDOR_SEQ:
            return None
        return (f"{seq_len:,} tokens is past the {LONGEST_CALIBRATED_VENDOR_SEQ:,} of the runs with the vendor's "
                "fused attention it comes from: longer ones kept apart were priced up to 48 % fast "
                "(profiles/runs/unmodelled_runs.csv)")
    if seq_len <= LONGEST_CALIBRATED_SEQ:
        return None
    return (f"{seq_len:,} tokens is past the {LONGEST_CALIBRATED_SEQ:,} of the runs it comes from: longer runs "
            "kept apart were priced up to 49 % fast (profiles/runs/unmodelled_runs.csv)")


def long_sequence_caveat(seq_len: int, cluster: ClusterSpec) -> str:
    """long_sequence_note as the summary line's tail: "; " and the note, or nothing."""
    note = long_sequence_note(seq_len, cluster)
    return f"; {note}" if note else ""

# Devices priced with another chip's fitted values (planner.measure.fit BORROWS) and checked on their
# own published runs, which no fit reads: those runs' MAPE of step time (docs/results.md's line for
# profiles/runs/gb200_runs.csv, `python3 scripts/results.py`; `planner validate` on the table gives the
# error of each row's published metric), the error a search or a prediction on them quotes where it
# is the larger.
BORROWED_ERROR_BANDS = {
    "GB200": (0.063, "its 46 published runs, priced with the H100 chip's fitted values: profiles/runs/gb200_runs.csv"),
    "B300": (0.084, "its 15 published runs, priced with the H100 chip's fitted values: profiles/runs/b300_runs.csv"),
    "GB300": (0.112, "its 33 published runs, priced with the H100 chip's fitted values: profiles/runs/gb300_runs.csv"),
}


def error_band(cluster: ClusterSpec) -> tuple[float, str]:
    """(the step-time error a search or a prediction on `cluster` quotes, where it comes from):
    MODEL_ERROR_BAND, or the larger error of a device the published runs do not bound: a profile
    fitted to its own probe steps (`planner profile` of a machine), those steps' error after the
    fit; a device priced with another chip's values, its own runs' (BORROWED_ERROR_BANDS)."""
    devices = [g.device for g in cluster.groups] or [cluster.device]
    bands = [(MODEL_ERROR_BAND, PUBLISHED), (max(d.probe_error for d in devices),
                                            "this machine's profile: its probe steps after the fit")]
    bands += [BORROWED_ERROR_BANDS[d.name] for d in devices if d.name in BORROWED_ERROR_BANDS]
    return max(bands, key=lambda b: b[0])
