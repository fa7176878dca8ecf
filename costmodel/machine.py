"""Which machine this is, without importing torch: the key of the cached `local` profile.

A measured profile is valid for one processor, core count, torch build and GPU model; any of them
changing makes a new key, so `--cluster 1xNxlocal` measures the new machine instead of reusing
another's figures. The cache lives in $PLANNER_CACHE_DIR, else $XDG_CACHE_HOME/planner, else
~/.cache/planner.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

LOCAL = "local"


class LocalProfileMissing(Exception):
    """`local` was asked for and this machine has no usable cached profile: the command line
    measures it (`planner profile`) and tries again."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{reason} ({path})")
        self.path, self.reason = path, reason


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_models() -> str:
    names = []
    root = Path("/proc/driver/nvidia/gpus")
    if root.is_dir():
        for info in sorted(root.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
    if not names and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return ", ".join(names)


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


@lru_cache(maxsize=1)
def identity() -> dict[str, str]:
    return {"processor": _processor(), "cores": str(os.cpu_count() or 1), "torch": _torch_version(),
            "gpu": _gpu_models()}


def describe(ident: dict[str, str] | None = None) -> str:
    ident = ident or identity()
    gpu = f", {ident['gpu']}" if ident["gpu"] else ""
    return f"{ident['processor']}, {ident['cores']} cores{gpu}, torch {ident['torch']}"


def machine_key(ident: dict[str, str] | None = None) -> str:
    text = json.dumps(ident or identity(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_dir() -> Path:
    if os.environ.get("PLANNER_CACHE_DIR"):
        return Path(os.environ["PLANNER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "planner"


def local_profile_path() -> Path:
    return cache_dir() / "profiles" / f"local-{machine_key()}.toml"
