"""``fxpar.Cluster``: the machine a plan is costed for (``pm.estimate``, ``fxpar.search``).

A cluster is ``gpus`` devices, ``gpus_per_node`` to a node. Each device has a dense peak FLOP/s per
dtype, HBM (bytes and bandwidth) and two links: inside a node and across nodes (bandwidth per device
and direction, latency per hop). The ``*_fraction`` fields are what a well-tuned kernel or collective
achieves of the datasheet peak; ``pm.estimate`` divides by them.

Presets hold public datasheet figures (sources next to each); ``Cluster.measure()`` times this
machine: matmul FLOP/s, memory bandwidth, and gloo all-reduce latency and bandwidth per group size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fxpar.errors import PlanError, close_matches

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """Devices, their peaks and their links; see the module docstring.

    ``peak_flops``: dense FLOP/s per device by dtype (``torch.float32`` is the non-tensor-core rate,
    as PyTorch's default fp32 matmul uses). ``collective_fit``: measured (latency, bandwidth) per group
    size, which replaces the link model for groups of that size (``Cluster.measure`` fills it).
    """

    name: str
    gpus: int
    gpus_per_node: int
    peak_flops: dict[torch.dtype, float]
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_bandwidth: float  # bytes/s per device and direction, inside a node
    intra_latency: float  # s per collective step inside a node
    inter_bandwidth: float  # bytes/s per device and direction, across nodes
    inter_latency: float  # s per collective step across nodes
    flops_fraction: float = 1.0
    hbm_fraction: float = 1.0
    link_fraction: float = 1.0
    device: str = "cuda"
    op_overhead: float = 0.0  # s per executed op (eager dispatch; presets: 0, kernels queue ahead of the GPU)
    collective_fit: dict[int, tuple[float, float]] = field(default_factory=dict)
    source: str = ""
    # Ranks sharing CPU cores (``Cluster.measure``; presets: one device per rank, both 1.0 and 0.0):
    oversubscription: float = 1.0  # ranks per core: a rank's idle time is CPU another rank can use
    sync_cost: dict[int, float] = field(default_factory=dict)  # s a blocking collective of a group of n costs
    # beyond its transfer while the other ranks compute (peers the OS has not scheduled yet), by group size n
    optimizer_overhead: float = 0.0  # s per parameter tensor of an eager AdamW step beyond its memory traffic

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise PlanError(f"Cluster.gpus must be a positive int, got {self.gpus!r}")
        if self.gpus_per_node < 1:
            raise PlanError(f"Cluster.gpus_per_node must be positive, got {self.gpus_per_node!r}")

    @staticmethod
    def preset(name: str, gpus: int = 8) -> Cluster:
        """A cluster of ``gpus`` devices of a known kind: ``"h100-sxm"`` or ``"a100-80g"`` (8 per node)."""
        if name not in PRESETS:
            hint = close_matches(name, list(PRESETS))
            raise PlanError(f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}"
                            + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        return dataclasses.replace(PRESETS[name], gpus=gpus)

    @staticmethod
    def measure(ranks: int = 4) -> Cluster:
        """This machine, timed: ``ranks`` processes sharing its cores, gloo between them (cached per process).

        Matmul FLOP/s (fp32, bf16) and copy bandwidth are those of one of ``ranks`` one-thread workers running at
        once (time-slicing the cores when there are more ranks than cores); the cost of dispatching one eager op
        is measured too (times ranks per core beyond one);
        gloo all-reduce latency and bandwidth are fitted for groups of 2 and 4 (threads of this process, each
        with its own gloo group on a local store). ``sync_cost[g]`` is what one small all-reduce in groups of ``g``
        adds to ``ranks`` threads that compute between collectives, over the same computation without it: the
        time a collective waits for peers the OS has not scheduled yet (threads and processes measure the same
        here: about 7 ms for groups of 4 and 2 ms for groups of 2 among 4 ranks on 2 cores). ``optimizer_overhead``
        is an eager AdamW step's cost per parameter tensor beyond its memory traffic.
        The first measurement on a machine is kept on disk and read back by later processes, so a plan chosen on
        it does not change from run to run (``fxpar.cluster_cache``; ``FXPAR_REMEASURE=1`` times it again).
        """
        if ranks not in _MEASURED:
            _MEASURED[ranks] = _measured(ranks)
        return _MEASURED[ranks]

    def sync(self, group: int) -> float:
        """``sync_cost`` of a group of ``group`` ranks: the measured size, else the nearest smaller one (0: none)."""
        sizes = [g for g in self.sync_cost if g <= group]
        return self.sync_cost[max(sizes)] if sizes else 0.0

    def with_gpus(self, gpus: int) -> Cluster:
        return dataclasses.replace(self, gpus=gpus)

    def flops(self, dtype: torch.dtype) -> float:
        """Achievable matmul FLOP/s of one device in ``dtype`` (fp8 falls back to bf16 when not listed)."""
        peak = self.peak_flops.get(dtype)
        if peak is None and dtype.itemsize == 1:
            peak = self.peak_flops.get(torch.bfloat16)
        if peak is None:
            peak = self.peak_flops.get(torch.bfloat16 if dtype.itemsize == 2 else torch.float32)
        return (peak or self.peak_flops[torch.float32]) * self.flops_fraction

    @property
    def memory_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.hbm_fraction

    def link(self, ranks: Sequence[int]) -> tuple[float, float]:
        """(latency per step in s, bandwidth in bytes/s) of a group of ``ranks`` (global rank numbers).

        A group whose ranks share a node (``rank // gpus_per_node``) uses the intra-node link, any other
        the inter-node one; a measured fit for the group's size wins over both.
        """
        if len(ranks) in self.collective_fit:
            return self.collective_fit[len(ranks)]
        if len({r // self.gpus_per_node for r in ranks}) == 1:
            return self.intra_latency, self.intra_bandwidth * self.link_fraction
        return self.inter_latency, self.inter_bandwidth * self.link_fraction

    def __str__(self) -> str:
        bf16 = self.peak_flops.get(torch.bfloat16, self.peak_flops[torch.float32])
        return (f"{self.name}: {self.gpus} devices ({self.gpus_per_node} per node), {bf16 / 1e12:.1f} TFLOP/s "
                f"dense bf16 peak, {self.hbm_bytes / GB:.0f} GB at {self.hbm_bandwidth / GB:.0f} GB/s, links "
                f"{self.intra_bandwidth / GB:.0f} GB/s intra / {self.inter_bandwidth / GB:.1f} GB/s inter node")


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): dense (non-sparse) tensor-core rates are half the
# "with sparsity" figures: BF16 989.4 TFLOP/s, FP8 1,978.9, TF32 494.7; FP32 (CUDA cores) 66.9. HBM3 80 GB at
# 3.35 TB/s; NVLink 4 900 GB/s per GPU (both directions: 450 each way). DGX H100 system: one ConnectX-7 NIC
# of 400 Gb/s per GPU (50 GB/s each way).
_H100 = Cluster(
    name="h100-sxm", gpus=8, gpus_per_node=8,
    peak_flops={torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float8_e4m3fn: 1978.9e12,
                torch.float32: 66.9e12},
    hbm_bytes=80 * GB, hbm_bandwidth=3350 * GB, intra_bandwidth=450 * GB, intra_latency=5e-6,
    inter_bandwidth=50 * GB, inter_latency=10e-6,
    # achievable: ~70% of dense bf16 peak on large GEMMs, ~80% of HBM, ~80% of link peak (NCCL bus bandwidth)
    flops_fraction=0.70, hbm_fraction=0.80, link_fraction=0.80,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100 user guide (8x ConnectX-7 400 Gb/s)",
)

# NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOP/s dense, TF32 156, FP32 19.5; HBM2e 80 GB at
# 2,039 GB/s; NVLink 3 600 GB/s per GPU (300 each way). DGX A100: one ConnectX-6 HDR NIC of 200 Gb/s per GPU.
_A100 = Cluster(
    name="a100-80g", gpus=8, gpus_per_node=8,
    peak_flops={torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    hbm_bytes=80 * GB, hbm_bandwidth=2039 * GB, intra_bandwidth=300 * GB, intra_latency=5e-6,
    inter_bandwidth=25 * GB, inter_latency=10e-6,
    flops_fraction=0.80, hbm_fraction=0.80, link_fraction=0.80,
    source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); DGX A100 user guide (8x ConnectX-6 HDR 200 Gb/s)",
)

PRESETS = {c.name: c for c in (_H100, _A100)}
_MEASURED: dict[int, Cluster] = {}
_CALIBRATIONS: list[Callable[[Cluster, int], Cluster]] = []  # fxpar.calibrate (it needs the compiler)


def _measured(ranks: int) -> Cluster:
    """This machine as ``ranks`` ranks see it: read from the disk cache, else timed (and calibrated) and kept."""
    from fxpar import cluster_cache

    key = cluster_cache.machine_key(ranks, _CALIBRATIONS)
    if not cluster_cache.remeasure() and (fields := cluster_cache.load(key)) is not None:
        try:
            return Cluster(**fields)
        except (TypeError, ValueError, PlanError):  # an entry from other fields: measure again
            pass
    from fxpar.measure import machine_fields

    measured = Cluster(**machine_fields(ranks))
    for calibrate in _CALIBRATIONS:
        measured = calibrate(measured, ranks)
    cluster_cache.store(key, dataclasses.asdict(measured))
    return measured


def register_calibration(fn: Callable[[Cluster, int], Cluster]) -> None:
    """Run ``fn(cluster, ranks)`` on every cluster ``Cluster.measure`` builds (``fxpar.calibrate`` registers one:
    this module sits below the compiler and cannot import it)."""
    _CALIBRATIONS.append(fn)
