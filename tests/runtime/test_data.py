"""Data addressed by global sample index: any data-parallel split sees the same global batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.data import TokenSource, local_slice


def test_dp_slices_tile_the_global_batch():
    src = TokenSource(256, 16, seed=1)
    whole_x, whole_y = src.batch(*local_slice(3, 8, 1, 0))
    parts = [src.batch(*local_slice(3, 8, 4, r)) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])   # labels are inputs shifted by one


def test_token_files_npy_and_bin(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 200
    np.save(tmp_path / "t.npy", tokens)
    tokens.tofile(tmp_path / "t.bin")
    a = TokenSource(256, 10, seed=0, path=tmp_path / "t.npy")
    b = TokenSource(256, 10, seed=0, path=tmp_path / "t.bin", dtype="uint16")
    assert torch.equal(a.sample(5), b.sample(5))
    assert a.sample(5).tolist() == list(range(50, 61))


def test_bad_token_files_are_clear_errors(tmp_path):
    np.save(tmp_path / "big.npy", np.array([0, 1, 300] * 10, dtype=np.uint16))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        TokenSource(256, 4, seed=0, path=tmp_path / "big.npy")
    with pytest.raises(ValueError, match="does not exist"):
        TokenSource(256, 4, seed=0, path=tmp_path / "missing.npy")
    np.save(tmp_path / "short.npy", np.arange(3, dtype=np.uint16))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        TokenSource(256, 4, seed=0, path=tmp_path / "short.npy")


def test_a_token_files_header_not_its_name_says_what_it_is(tmp_path):
    """A .npy array by another name is read as an array (never its header as tokens); a file
    named .npy without NumPy's header, and an .npz archive, are refused by what they are."""
    tokens = np.arange(1000, dtype=np.uint16) % 200
    np.save(tmp_path / "t.npy", tokens)
    (tmp_path / "t.npy").rename(tmp_path / "tokens_npy.dat")
    renamed = TokenSource(256, 10, seed=0, path=tmp_path / "tokens_npy.dat")
    assert renamed.sample(5).tolist() == list(range(50, 61))
    (tmp_path / "junk.npy").write_bytes(b"not an array at all" * 10)
    with pytest.raises(ValueError, match="junk.npy is not a .npy array \\(no NumPy header\\)"):
        TokenSource(256, 10, seed=0, path=tmp_path / "junk.npy")
    np.savez(tmp_path / "t.npz", tokens=tokens)
    with pytest.raises(ValueError, match="is a zip archive"):
        TokenSource(256, 10, seed=0, path=tmp_path / "t.npz")
