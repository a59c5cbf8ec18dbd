"""``Cluster.measure()`` results kept on disk, one per machine and rank count.

``plan=None`` and ``plan="auto"`` on a CPU mesh cost plans on this machine measured (``fxpar.measure``, about 5 s).
Timings vary from run to run, and two plans within that noise of each other could swap between two runs of the
same script: the printed program changed with nothing changed by the user. The first measurement on a machine is
written to ``$FXPAR_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fxpar``, else ``~/.cache/fxpar``) and later processes
read it, so the same model, mesh and inputs give the same plan run after run, as Inductor's autotuning cache does.
The key is the machine (host, CPU model, cores this process may use), torch's version, the measuring code, the
rank count and the calibrations registered; ``FXPAR_REMEASURE=1`` times the machine again and replaces the entry.
A cache that cannot be read or written is ignored: the machine is measured, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

CACHE_DIR_ENV = "FXPAR_CACHE_DIR"
REMEASURE_ENV = "FXPAR_REMEASURE"
FORMAT = 1  # bump when the fields measured, or how, change


def cache_file() -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fxpar")
    return Path(root) / "measured_clusters.json"


def machine_key(ranks: int, calibrations: Iterable[Callable[..., Any]]) -> str:
    """What a measurement depends on besides the load of the moment."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = {"format": FORMAT, "host": platform.node(), "cpu": _cpu_model(), "cores": cores,
             "torch": torch.__version__, "code": _measuring_code(calibrations), "ranks": ranks,
             "calibrations": [f"{fn.__module__}.{fn.__qualname__}" for fn in calibrations]}
    return json.dumps(parts, sort_keys=True)


def _measuring_code(calibrations: Iterable[Callable[..., Any]]) -> str:
    """A digest of the code that measures (``fxpar.measure`` and each calibration's module): another fxpar measures
    anew."""
    import fxpar.measure

    digest = hashlib.sha256()
    for module in (fxpar.measure, *(sys.modules[fn.__module__] for fn in calibrations)):
        digest.update(Path(module.__file__ or "").read_bytes())
    return digest.hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def remeasure() -> bool:
    return os.environ.get(REMEASURE_ENV, "0") not in ("", "0")


def load(key: str) -> dict[str, Any] | None:
    """The ``Cluster`` fields stored under ``key``, or None."""
    entry = _read().get(key)
    return _decode(entry["fields"]) if entry else None


def store(key: str, fields: dict[str, Any]) -> None:
    """Keep ``fields`` under ``key`` (atomically: a reader sees the old file or the new one)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read()
        entries[key] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "fields": _encode(fields)}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".measured_clusters.")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measure every time, as without a cache


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _encode(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON for ``Cluster`` fields: dict keys (dtypes, group sizes) as strings, tuples as lists."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, dict):
            out[name] = {"dict": [[str(k), list(v) if isinstance(v, tuple) else v] for k, v in value.items()]}
        else:
            out[name] = value
    return out


def _decode(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, dict) and "dict" in value:
            out[name] = {_key(k): tuple(v) if isinstance(v, list) else v for k, v in value["dict"]}
        else:
            out[name] = value
    return out


def _key(text: str) -> Any:
    if text.startswith("torch."):
        return getattr(torch, text.split(".", 1)[1])
    return int(text)
