"""Checkpoints and failures: what they cost a long run, and how often to checkpoint.

A checkpoint writes the training state (runtime.checkpoint: master weights and optimizer states
through torch.distributed.checkpoint, which writes a replicated tensor once and spreads the
writing over the ranks), and the step waits for it (the runtime saves synchronously), then for
each rank to read back and hash its share of the files for the checkpoint's manifest
(runtime.manifest; a resume verifies them the same way before loading). Failures
arrive at a rate proportional to the number of devices; after one, the work since the last
checkpoint is lost and the job restarts from it. Young (1974) and Daly (2006): checkpoint every
tau = sqrt(2 * delta * M) seconds of work, delta the write time and M the job's mean time between
failures; the expected share of time lost is then about delta / (tau + delta) + (tau / 2 + R) / M.

The assumptions, printed with every estimate (`Failures`; LLAMA3 unless the user states others
with `--device-mtbf-hours` / `--storage-mb-s-per-device`):
- failure rate: Llama 3 (Dubey et al. 2024, arXiv 2407.21783, Sec. 3.3.4): 419 unexpected
  interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs, 1.97e-5 per device-hour;
- storage: the same section's Tectonic file system sustains 2 TB/s for those 16,384 GPUs, 122 MB/s
  per device, taken as provisioned with the cluster;
- hashing: SHA-256 at 1.4 GB/s on one core per rank (measured: `python3 -c "import hashlib, os;
  hashlib.sha256(os.urandom(1 << 27))"` timed on an AMD EPYC with SHA-NI, 1.4 GB/s; OpenSSL's
  `openssl speed -evp sha256` reports 1.5-2 GB/s on SHA-NI cores of Intel Ice Lake and AMD Zen);
- restart R: reading the checkpoint back at the same bandwidth and verifying its checksums;
  process start, rendezvous and the lost step in flight are not counted (a lower bound).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.inputs import UserError
from costmodel.memory import optimizer_bytes_per_param
from costmodel.params import total_params
from costmodel.specs import ModelSpec, TrainSpec

FAILURES_PER_DEVICE_HOUR = 419 / (54 * 24 * 16_384)   # Llama 3, Sec. 3.3.4
STORAGE_BYTES_PER_S_PER_DEVICE = 2e12 / 16_384         # Llama 3: Tectonic, 2 TB/s sustained
HASH_BYTES_PER_S_PER_DEVICE = 1.4e9                    # SHA-256 on one core per rank (see above)
SOURCE = ("Llama 3 (arXiv 2407.21783) Sec. 3.3.4: 419 interruptions in 54 days on 16,384 GPUs; "
          "storage 2 TB/s sustained for them")


@dataclass(frozen=True, kw_only=True, slots=True)
class Failures:
    """How often a device fails and how fast storage takes a checkpoint, with where that came from."""
    failures_per_device_hour: float
    storage_bytes_per_s_per_device: float
    source: str
    rate_name: str   # how summary_line names the rate

    def __post_init__(self) -> None:
        if not (self.failures_per_device_hour > 0 and self.storage_bytes_per_s_per_device > 0):
            raise UserError("the failure rate and the storage bandwidth must be positive")


LLAMA3 = Failures(failures_per_device_hour=FAILURES_PER_DEVICE_HOUR,
                  storage_bytes_per_s_per_device=STORAGE_BYTES_PER_S_PER_DEVICE, source=SOURCE,
                  rate_name="Llama 3's rate")


MTBF_HOURS_RANGE = (1e-3, 1e12)
STORAGE_MB_S_RANGE = (1e-3, 1e9)


def stated(device_mtbf_hours: float | None, storage_mb_s_per_device: float | None) -> Failures:
    """LLAMA3 with what the user stated in its place (the flags of search, predict and run)."""
    if device_mtbf_hours is None and storage_mb_s_per_device is None:
        return LLAMA3
    # beyond these the arithmetic of a job's MTBF and a checkpoint's write leaves the floats
    # (a device failing once in 10^12 hours, storage slower than a kilobyte a second)
    if device_mtbf_hours is not None and not MTBF_HOURS_RANGE[0] <= device_mtbf_hours <= MTBF_HOURS_RANGE[1]:
        raise UserError(f"--device-mtbf-hours {device_mtbf_hours:g}: give {MTBF_HOURS_RANGE[0]:g} to "
                        f"{MTBF_HOURS_RANGE[1]:g} hours")
    if storage_mb_s_per_device is not None and not STORAGE_MB_S_RANGE[0] <= storage_mb_s_per_device <= STORAGE_MB_S_RANGE[1]:
        raise UserError(f"--storage-mb-s-per-device {storage_mb_s_per_device:g}: give {STORAGE_MB_S_RANGE[0]:g} to "
                        f"{STORAGE_MB_S_RANGE[1]:g} MB/s")
    rate = LLAMA3.failures_per_device_hour if device_mtbf_hours is None else 1.0 / device_mtbf_hours
    storage = (LLAMA3.storage_bytes_per_s_per_device if storage_mb_s_per_device is None
               else storage_mb_s_per_device * 1e6)
    said = [f"--device-mtbf-hours {device_mtbf_hours:g}"] if device_mtbf_hours is not None else []
    said += [f"--storage-mb-s-per-device {storage_mb_s_per_device:g}"] if storage_mb_s_per_device is not None else []
    kept = ([] if device_mtbf_hours is not None else ["failure rate"]) + \
        ([] if storage_mb_s_per_device is not None else ["storage bandwidth"])
    source = "stated: " + ", ".join(said) + (f"; {' and '.join(kept)} from {SOURCE}" if kept else "")
    name = (f"one failure per {device_mtbf_hours:,.0f} device-hours" if device_mtbf_hours is not None
            else LLAMA3.rate_name)
    return Failures(failures_per_device_hour=rate, storage_bytes_per_s_per_device=storage, source=source,
                    rate_name=name)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointCost:
    state_bytes: float          # what one checkpoint writes, all ranks together
    write_s: float              # delta: the step waits this long per checkpoint (write + checksum pass)
    mtbf_s: float               # M: the job's mean time between failures
    interval_s: float           # tau: Young/Daly's optimum, in seconds of training
    interval_steps: int         # tau in whole steps (at least one)
    lost_fraction: float        # expected share of wall time lost to checkpoints and failures
    effective_tokens_per_s: float
    failures: Failures = LLAMA3

    def to_dict(self) -> dict[str, float | int | str]:
        return {"state_bytes": self.state_bytes, "write_s": self.write_s, "mtbf_s": self.mtbf_s,
                "interval_s": self.interval_s, "interval_steps": self.interval_steps,
                "lost_fraction": self.lost_fraction, "effective_tokens_per_s": self.effective_tokens_per_s,
                "failures_per_device_hour": self.failures.failures_per_device_hour,
                "storage_bytes_per_s_per_device": self.failures.storage_bytes_per_s_per_device,
                "source": self.failures.source}


def checkpoint_cost(model: ModelSpec, train: TrainSpec, world_size: int, step_time_s: float,
                    tokens_per_s: float, failures: Failures = LLAMA3) -> CheckpointCost:
    # the weights (fp32 masters where 16-bit compute keeps them, else the weights themselves) and
    # the optimizer's states
    weights = 0 if train.master_weights_fp32 else train.compute_dtype.num_bytes
    state = total_params(model) * (optimizer_bytes_per_param(train) + weights)
    # written, then read back and hashed (the manifest), each rank its share
    write_s = state / world_size * (1.0 / failures.storage_bytes_per_s_per_device + 1.0 / HASH_BYTES_PER_S_PER_DEVICE)
    mtbf_s = 3600.0 / (world_size * failures.failures_per_device_hour)
    tau = math.sqrt(2.0 * write_s * mtbf_s)
    steps = max(1, round(tau / step_time_s))
    tau = steps * step_time_s   # what a run can do: checkpoint after whole steps
    lost = write_s / (tau + write_s) + (tau / 2.0 + write_s) / mtbf_s
    return CheckpointCost(state_bytes=state, write_s=write_s, mtbf_s=mtbf_s, interval_s=tau,
                          interval_steps=steps, lost_fraction=min(lost, 1.0),
                          effective_tokens_per_s=tokens_per_s * max(0.0, 1.0 - lost), failures=failures)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 7200 else f"{seconds / 60:,.0f} min"


def summary_line(cost: CheckpointCost) -> str:
    return (f"checkpoint every {cost.interval_steps:,} steps ({_duration(cost.interval_s)}, Young/Daly), "
            f"{cost.state_bytes / 1e9:,.0f} GB written in {cost.write_s:.0f} s "
            f"({cost.failures.storage_bytes_per_s_per_device / 1e6:,.0f} MB/s per device); failures every "
            f"{_duration(cost.mtbf_s)} at {cost.failures.rate_name}; effective {cost.effective_tokens_per_s:,.0f} tokens/s "
            f"(-{100 * cost.lost_fraction:.2f}%)")
