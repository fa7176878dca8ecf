"""Shared fixtures: small, named specs so tests read like the formulas they check."""
from __future__ import annotations

import pytest

from costmodel.cluster import parse_cluster
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec


@pytest.fixture
def llama70b():
    return resolve_model("llama-70b")


@pytest.fixture
def a100_64():
    return parse_cluster("8x8xA100")


@pytest.fixture
def train_4k():
    return TrainSpec(seq_len=4096, global_batch_size=1024)
