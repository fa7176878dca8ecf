"""Training data addressed by global sample index.

Sample `i` of step `t` is global sample `t * global_batch_size + i`, whatever the plan: every
data-parallel rank takes its contiguous slice of the global batch, split into micro-batches in
order. So any two plans of the same TrainSpec see the same global batch at every step, and a
single process can replay it (what the parity tests rely on).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from costmodel.inputs import UserError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenSource:
    """Synthetic seeded tokens, or windows of a token file (.npy, or raw .bin with `dtype`)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, path: Path | None = None,
                 dtype: str = "uint16", checked_tokens: int = 1 << 20) -> None:
        """`checked_tokens`: how many of the file's first tokens are checked to be in the
        vocabulary (`planner run` checks all a run will read, once, before any rank starts)."""
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.tokens = None if path is None else _open_tokens(Path(path), dtype)
        if self.tokens is not None:
            if len(self.tokens) < seq_len + 1:
                raise UserError(f"token file {path}: {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
            chunk = 1 << 24
            for start in range(0, min(len(self.tokens), checked_tokens), chunk):
                part = self.tokens[start:min(start + chunk, checked_tokens)]
                low, top = int(part.min()), int(part.max())
                if low < 0 or top >= vocab_size:
                    raise UserError(f"token file {path}: token id {low if low < 0 else top} is outside the "
                                     f"model's vocabulary [0, {vocab_size})")

    def sample(self, index: int) -> torch.Tensor:
        """seq_len + 1 tokens: inputs are [:-1], labels [1:]."""
        n = self.seq_len + 1
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            return torch.randint(self.vocab_size, (n,), generator=gen)
        windows = (len(self.tokens) - 1) // self.seq_len
        start = (index % windows) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + n].astype(np.int64))

    def batch(self, first_index: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.sample(first_index + i) for i in range(num_samples)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def local_slice(step: int, global_batch_size: int, dp: int, dp_rank: int,
                samples: tuple[int, ...] = ()) -> tuple[int, int]:
    """(first global sample index, number of samples) of one data-parallel rank at a step;
    `samples`: each replica's share when they differ (costmodel.groups.replica_samples), in
    replica order, adding up to the global batch."""
    if samples:
        return step * global_batch_size + sum(samples[:dp_rank]), samples[dp_rank]
    per_rank = global_batch_size // dp
    return step * global_batch_size + dp_rank * per_rank, per_rank


NPY_MAGIC = b"\x93NUMPY"      # numpy.lib.format.MAGIC_PREFIX
ZIP_MAGIC = b"PK\x03\x04"      # numpy.savez's archive


def _open_tokens(path: Path, dtype: str) -> np.ndarray:
    if not path.exists():
        raise UserError(f"token file {path} does not exist")
    if not path.is_file():
        raise UserError(f"token file {path} is not a file")
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"token dtype must be one of {sorted(TOKEN_DTYPES)} (got {dtype!r})")
    # the file's own first bytes say what it is, whatever its name: a raw file read as tokens
    # would train its header as tokens
    with open(path, "rb") as f:
        head = f.read(len(NPY_MAGIC))
    if head.startswith(ZIP_MAGIC) and path.suffix in (".npy", ".npz"):   # raw ids may begin so (19280, 1027)
        raise UserError(f"token file {path} is a zip archive (an .npz?): save the token ids as one array with "
                        "numpy.save (.npy) or as raw uint16/uint32 (.bin)")
    npy = head == NPY_MAGIC
    if path.suffix == ".npy" and not npy:
        raise UserError(f"token file {path} is not a .npy array (no NumPy header): a raw file is read by "
                        "another name, e.g. .bin, with --data-dtype")
    try:
        if not npy:
            return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:   # numpy's words for a file it cannot map
        raise UserError(f"token file {path} is not a {'.npy array' if npy else dtype + ' file'} "
                        f"({str(exc).splitlines()[0]})") from None
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
        raise UserError(f"token file {path}: expected a 1-D array of integer token ids, got {tokens.dtype} {tokens.shape}")
    return tokens
