"""Hardware and cluster profiles as data: devices, links, cluster hierarchies.

A :class:`DeviceProfile` holds what a roofline needs (peak FLOP/s per dtype, memory capacity
and bandwidth, per-kernel overhead, achievable-efficiency factors); a :class:`ClusterProfile`
is a device plus a hierarchy of :class:`ClusterLevel` s (chip -> node -> supernode -> scale-out
network), each with its devices per unit and the :class:`LinkProfile` (bandwidth, latency) that
joins devices at that level. Built-in profiles carry the public source of their numbers in
``source``; ``local`` comes from ``graphopt calibrate`` (see :mod:`graphopt.cost.calibrate`).

Units: FLOP/s, bytes, bytes/s, seconds. Peak FLOP/s are dense (no 2:4 sparsity).
Load from JSON/YAML with :func:`load_profile`; errors name the field and the fix.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from graphopt.errors import ConfigError

GB = 1e9
TB = 1e12
GiB = 1024**3


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or this CPU).

    peak_flops: dense peak per dtype name ("float32", "bfloat16", "float16", "float8"), FLOP/s.
    memory_bytes: device memory capacity, bytes. memory_bandwidth: bytes/s.
    kernel_overhead_s: fixed cost per launched kernel (launch + tail), seconds.
    matmul_efficiency / memory_efficiency: achievable fraction of peak for large GEMMs /
    streaming kernels (defaults from common measurements; ``calibrate`` fits them locally).
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    kernel_overhead_s: float = 5e-6
    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    source: str = ""
    attention_efficiency: float = 0.5
    """Fused attention kernels (flash/efficient/cuDNN SDPA) reach this fraction of the matmul
    rate on the FLOPs they execute (a causal kernel skips the scores above the diagonal:
    ``graph_cost.causal_fraction``; softmax, exp and masking run between the GEMMs). 0.5 of
    a 0.7 matmul efficiency is 35% of peak: FlashAttention-2 (SDPA's flash kernel) on H100 as
    FlashAttention-3 reports it (Shah et al. 2024, abstract); FlashAttention-2 reports 50-73%
    of peak on A100 (Dao 2023). Calibrated locally."""
    host_bandwidth: float = 25e9
    """Bytes/s between device and host memory per direction (PCIe 4.0 x16 ~25 GB/s; PCIe 5.0
    ~50 GB/s; NVLink-C2C on GB200 ~450 GB/s); prices offloading."""
    kind: str = "gpu"
    """"gpu" | "npu" | "cpu": which kernels a fake trace models (fused flash attention on
    accelerators; PyTorch's CPU kernels for "cpu")."""
    threads: int | None = None
    """Calibrated CPU profiles: the torch thread count the rates were measured with (they
    scale with it); :func:`graphopt.cost.estimate` warns when the current count differs."""
    gemm_table: str = ""
    """A measured GEMM-shape table of :mod:`graphopt.cost.gemm_table` (``"sm90-bf16"`` for
    H100/H200) or "": the planner prices each bf16/fp16 GEMM of a layer at its per-rank
    shape, ``matmul_efficiency`` x the table's rate for that shape relative to its best one
    (``matmul_efficiency`` is then the efficiency of the largest GEMMs)."""
    matmul_curve: tuple[tuple[float, float], ...] = ()
    """Calibrated profiles only: (GEMM size n, achieved float32 FLOP/s) points, n the cube
    root of m*n*k of one GEMM; :func:`graphopt.cost.graph_cost.matmul_rate` interpolates them
    and scales them to other dtypes by their ``peak_flops`` ratio to float32."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"device name must be a string, got {self.name!r}")
        curve = self.matmul_curve
        if not isinstance(curve, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(
                    _number(x) and x > 0 for x in p) for p in curve):
            raise ConfigError(f"device {self.name!r}: matmul_curve must be a list of [GEMM "
                              f"size n > 0, FLOP/s > 0] pairs, got {curve!r}")
        from graphopt.cost.gemm_table import GEMM_TABLES

        if not isinstance(self.gemm_table, str) or (
                self.gemm_table and self.gemm_table not in GEMM_TABLES):
            raise ConfigError(f"device {self.name!r}: gemm_table must be one of "
                              f"{', '.join(map(repr, GEMM_TABLES))} or \"\", got "
                              f"{self.gemm_table!r}")
        if not isinstance(self.peak_flops, Mapping):
            raise ConfigError(f"device {self.name!r}: peak_flops must map dtype names to "
                              f"positive FLOP/s, got {self.peak_flops!r}")
        object.__setattr__(self, "matmul_curve",
                           tuple((float(a), float(b)) for a, b in curve))
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        _positive(self, "host_bandwidth")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(
                self.threads, int) or self.threads < 1):
            raise ConfigError(f"device {self.name!r}: threads must be an int >= 1 or null, got "
                              f"{self.threads!r}")
        if self.kind not in ("gpu", "npu", "cpu"):
            raise ConfigError(f"device {self.name!r}: kind must be gpu, npu or cpu, got "
                              f"{self.kind!r}")
        _positive(self, "memory_bytes", "memory_bandwidth")
        _non_negative(self, "kernel_overhead_s")
        for key in ("matmul_efficiency", "memory_efficiency", "attention_efficiency"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"device {self.name!r}: {key} must be in (0, 1], got "
                                  f"{value!r}")
        if not self.peak_flops or not all(
                _number(v) and v > 0 for v in self.peak_flops.values()):
            raise ConfigError(f"device {self.name!r}: peak_flops must map dtype names to "
                              f"positive FLOP/s, got {dict(self.peak_flops)!r}")
        unknown = sorted(set(self.peak_flops) - set(PEAK_DTYPES))
        if unknown or "float32" not in self.peak_flops:
            # a typo ("fp32") made float32 ops run at the bf16 rate: 10x too fast, silently
            raise ConfigError(f"device {self.name!r}: peak_flops needs 'float32' (also the "
                              "rate of integer ops) and dtype names from "
                              f"{', '.join(PEAK_DTYPES)}; got {', '.join(self.peak_flops)}")

    def require_rate(self, dtype: str) -> None:
        """Raise ConfigError when a ``dtype`` run (bfloat16/float16) has no rate of its own
        in ``peak_flops``: :meth:`flops_for` would price it at the float32 rate and MFU
        would be quoted against that peak (a review: a "bfloat16" plan 11x slow at 63%
        MFU). The run's entry points (the planner's model, :func:`estimate`) call it."""
        if dtype in ("bfloat16", "float16") and not {"bfloat16", "float16"} & set(
                self.peak_flops):
            raise ConfigError(
                f"device {self.name!r}: peak_flops has no {dtype!r} entry, so a {dtype} run "
                f"would be priced at the float32 rate "
                f"({float(self.peak_flops['float32']):.3g} FLOP/s) and its MFU quoted "
                f"against it; add {dtype!r} (the datasheet's dense rate) to the profile's "
                "peak_flops, or run in float32")

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float64 falls back to float32 / 2 when not listed;
        integer and bool ops count at the float32 rate)."""
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        if dtype == "float64" and "float32" in self.peak_flops:
            return float(self.peak_flops["float32"]) / 2
        if dtype in ("float16", "bfloat16"):
            for alt in ("bfloat16", "float16"):
                if alt in self.peak_flops:
                    return float(self.peak_flops[alt])
        return float(self.peak_flops.get("float32", max(self.peak_flops.values())))


class ProfileWarning(UserWarning):
    """A cluster profile that loads but looks mistaken (levels in an unusual order)."""


@dataclass(frozen=True)
class LinkProfile:
    """A link class: per-device unidirectional bandwidth (bytes/s) and latency (s)."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        _positive(self, "bandwidth")
        _non_negative(self, "latency")


@dataclass(frozen=True)
class ClusterLevel:
    """One level of the hierarchy: ``size`` units of the level below form one unit here
    (level 0: devices per node), joined by ``link``."""

    name: str
    size: int
    link: LinkProfile

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"cluster level {self.name!r}: size must be an int >= 1, got "
                              f"{self.size!r}")


@dataclass(frozen=True)
class ClusterProfile:
    """A device type and the levels that connect devices, innermost first."""

    name: str
    device: DeviceProfile
    levels: tuple[ClusterLevel, ...]
    source: str = ""

    def __post_init__(self) -> None:
        # levels go innermost first, so links get no faster outward; a list given outermost
        # first (the network as level 0) was accepted and changed the best plan (a review)
        # (a warning, not an error: PCIe nodes with one 400G NIC per GPU are real, a
        # re-review)
        for inner, outer in zip(self.levels, self.levels[1:]):
            if outer.link.bandwidth > inner.link.bandwidth:
                import warnings

                warnings.warn(
                    f"cluster {self.name!r}: level {outer.name!r} "
                    f"({outer.link.bandwidth:.3g} B/s) is faster than {inner.name!r} "
                    f"({inner.link.bandwidth:.3g} B/s), the level inside it; levels go "
                    "innermost first (level 0: devices per node), each next level's size "
                    "counting units of the one before: check the order if this is not a "
                    "cluster whose network outruns its nodes' links (PCIe GPUs with a NIC "
                    "each)", ProfileWarning, stacklevel=3)

    @property
    def max_devices(self) -> int:
        return math.prod(level.size for level in self.levels)

    def level_of(self, span: int) -> int:
        """The innermost level whose units hold ``span`` consecutive devices.

        Raises:
            ConfigError: ``span`` exceeds the cluster.
        """
        if span > self.max_devices:
            raise ConfigError(f"a group of {span} devices does not fit cluster {self.name!r} "
                              f"({self.max_devices} devices); use a larger cluster profile")
        size = 1
        for i, level in enumerate(self.levels):
            size *= level.size
            if span <= size:
                return i
        return len(self.levels) - 1  # pragma: no cover - guarded above

    def devices_per(self, level: int) -> int:
        """Devices in one unit of ``level`` (0: a node)."""
        return math.prod(lv.size for lv in self.levels[:level + 1])

    def with_rate_of(self, traced: str, runs: str) -> ClusterProfile:
        """This cluster with ``traced``'s FLOP rate set to ``runs``'s: for a model the planner
        traces in one dtype (MoE models: bf16, grouped_mm's meta kernel) that runs in
        another (fp32 on a CPU, whose bf16 GEMM is far slower)."""
        import dataclasses

        peak = dict(self.device.peak_flops, **{traced: self.device.flops_for(runs)})
        return dataclasses.replace(self, device=dataclasses.replace(self.device,
                                                                    peak_flops=peak))

    def scaled(self, devices: int) -> ClusterProfile:
        """The same cluster with its outermost level sized for at least ``devices``."""
        inner = self.devices_per(len(self.levels) - 2) if len(self.levels) > 1 else 1
        outer = max(1, math.ceil(devices / inner))
        last = self.levels[-1]
        return ClusterProfile(self.name, self.device,
                              (*self.levels[:-1], ClusterLevel(last.name, outer, last.link)),
                              self.source)


PEAK_DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")
"""The dtype names a device's ``peak_flops`` may list."""


def _number(value: Any) -> bool:
    """A finite int or float (not a bool: True would be read as 1 FLOP/s)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and \
        math.isfinite(value)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not _number(value) or not value > 0:  # finite: inf gave NaN step times (a review)
            raise ConfigError(f"{type(obj).__name__}: {name} must be a positive finite "
                              f"number, got {value!r}")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not _number(value) or value < 0:
            raise ConfigError(f"{type(obj).__name__}: {name} must be a finite number >= 0, "
                              f"got {value!r}")


# ---------------------------------------------------------------------------------------
# Built-in profiles. Peak numbers: vendor datasheets (dense, no sparsity). Link bandwidths are
# per device and per direction. Efficiencies are typical measured fractions (MLPerf/NCCL-tests
# reports); calibrate the local profile rather than trusting them.

_NVLINK3 = LinkProfile(bandwidth=300 * GB, latency=3e-6)   # A100: 600 GB/s bidirectional
_NVLINK4 = LinkProfile(bandwidth=450 * GB, latency=3e-6)   # H100/H200: 900 GB/s bidir.
_NVLINK5 = LinkProfile(bandwidth=900 * GB, latency=3e-6)   # B200/GB200: 1.8 TB/s bidir.
_IB_200 = LinkProfile(bandwidth=25 * GB, latency=5e-6)     # HDR 200 Gb/s per GPU
_IB_400 = LinkProfile(bandwidth=50 * GB, latency=5e-6)     # NDR 400 Gb/s per GPU
_HCCS = LinkProfile(bandwidth=196 * GB, latency=5e-6)      # 910B HCCS: 392 GB/s bidir.
_ROCE_200 = LinkProfile(bandwidth=25 * GB, latency=8e-6)   # 200 Gb/s RoCE per NPU
_UB_910C = LinkProfile(bandwidth=196 * GB, latency=2e-6)   # CloudMatrix384 UB per NPU die

DEVICES: dict[str, DeviceProfile] = {
    "a100-80gb": DeviceProfile(
        "A100-SXM4-80GB", {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12,
                           "float16": 312e12}, 80 * GB, 2039 * GB, 5e-6, 0.75, 0.85,
        "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB column"),
    "h100-sxm": DeviceProfile(
        "H100-SXM5-80GB", {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12,
                           "float16": 989.5e12, "float8": 1979e12}, 80 * GB, 3350 * GB, 4e-6,
        0.7, 0.85, "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense)",
        host_bandwidth=50e9, gemm_table="sm90-bf16"),
    "h200": DeviceProfile(
        "H200-SXM-141GB", {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12,
                           "float16": 989.5e12, "float8": 1979e12}, 141 * GB, 4800 * GB, 4e-6,
        0.7, 0.85, "NVIDIA H200 Tensor Core GPU datasheet, SXM column (dense)",
        host_bandwidth=50e9, gemm_table="sm90-bf16"),
    "b200": DeviceProfile(
        "B200", {"float32": 80e12, "tf32": 1100e12, "bfloat16": 2250e12, "float16": 2250e12,
                 "float8": 4500e12}, 180 * GB, 7700 * GB, 4e-6, 0.65, 0.85,
        "NVIDIA DGX B200 / HGX B200 datasheet (per GPU, dense)", host_bandwidth=50e9),
    "gb200": DeviceProfile(
        "GB200 (B200 GPU in NVL72)", {"float32": 80e12, "tf32": 1250e12,
                                      "bfloat16": 2500e12, "float16": 2500e12,
                                      "float8": 5000e12}, 186 * GB, 8000 * GB, 4e-6, 0.65,
        0.85, "NVIDIA GB200 NVL72 datasheet (per GPU, dense = half the sparse figures)",
        host_bandwidth=450e9),
    "ascend-910b": DeviceProfile(
        "Ascend 910B", {"float32": 94e12, "bfloat16": 376e12, "float16": 376e12},
        64 * GB, 1600 * GB, 8e-6, 0.6, 0.8,
        "Huawei Ascend 910B public specifications (910B2: 376 TFLOPS FP16, 64 GB HBM2e)",
        kind="npu"),
    "ascend-910c": DeviceProfile(
        "Ascend 910C", {"float32": 188e12, "bfloat16": 752e12, "float16": 752e12},
        128 * GB, 3200 * GB, 8e-6, 0.6, 0.8,
        "Huawei CloudMatrix384 paper (Zuo et al. 2025, arXiv:2506.12708), Table 1: 910C "
        "package of two dies, 752 TFLOPS BF16 dense, 128 GB, 3.2 TB/s", kind="npu"),
}


def _cluster(name: str, device: str, levels: list[tuple[str, int, LinkProfile]],
             source: str) -> ClusterProfile:
    return ClusterProfile(name, DEVICES[device],
                          tuple(ClusterLevel(n, s, link) for n, s, link in levels), source)


CLUSTERS: dict[str, ClusterProfile] = {
    "a100-80gb": _cluster("a100-80gb", "a100-80gb",
                          [("node", 8, _NVLINK3), ("network", 512, _IB_200)],
                          "DGX A100: 8 GPUs, NVLink3/NVSwitch, 8x HDR 200 Gb/s InfiniBand"),
    "h100-sxm": _cluster("h100-sxm", "h100-sxm",
                         [("node", 8, _NVLINK4), ("network", 512, _IB_400)],
                         "DGX H100: 8 GPUs, NVLink4 900 GB/s, 8x NDR 400 Gb/s InfiniBand"),
    "h200": _cluster("h200", "h200", [("node", 8, _NVLINK4), ("network", 512, _IB_400)],
                     "HGX H200: 8 GPUs, NVLink4 900 GB/s, 400 Gb/s InfiniBand per GPU"),
    "b200": _cluster("b200", "b200", [("node", 8, _NVLINK5), ("network", 512, _IB_400)],
                     "DGX B200: 8 GPUs, NVLink5 1.8 TB/s, 400 Gb/s per GPU"),
    "gb200-nvl72": _cluster("gb200-nvl72", "gb200",
                            [("nvl72", 72, _NVLINK5), ("network", 256, _IB_400)],
                            "GB200 NVL72: 72 GPUs in one NVLink5 domain (1.8 TB/s per GPU)"),
    "ascend-910b": _cluster("ascend-910b", "ascend-910b",
                            [("node", 8, _HCCS), ("network", 512, _ROCE_200)],
                            "Atlas 800T A2: 8x 910B, HCCS full mesh, 200 Gb/s RoCE per NPU"),
    "ascend-910c": _cluster("ascend-910c", "ascend-910c",
                            [("node", 8, _HCCS), ("network", 512, _ROCE_200)],
                            "910C servers of 8 NPUs, HCCS within, RoCE across"),
    "cloudmatrix384": _cluster("cloudmatrix384", "ascend-910c",
                               [("supernode", 384, _UB_910C), ("network", 64, _ROCE_200)],
                               "Huawei CloudMatrix384 (arXiv:2506.12708): 384 Ascend 910C on "
                               "one Unified Bus network, 392 GB/s UB per die; RoCE scale-out"),
}


DEFAULT_PROFILE = "h100-sxm"
"""The profile used when none is given and this machine has not been calibrated."""


def local_profile_path() -> Path:
    """Where ``graphopt calibrate`` writes the ``local`` profile:
    ``$GRAPHOPT_CACHE_DIR/local.json`` (default ``~/.cache/graphopt/local.json``)."""
    root = Path(os.environ.get("GRAPHOPT_CACHE_DIR", Path.home() / ".cache" / "graphopt"))
    return root / "local.json"


def default_profile_name() -> str:
    """The profile to use when the caller names none: "local" when ``graphopt calibrate``
    has written it (:func:`local_profile_path` exists), else :data:`DEFAULT_PROFILE`.
    The one place this rule lives; every default in graphopt goes through it."""
    return "local" if local_profile_path().exists() else DEFAULT_PROFILE


def profile_names() -> list[str]:
    """Names :func:`load_profile` accepts besides files: the built-ins and "local"."""
    return [*CLUSTERS, "local"]


def load_profile(spec: str | Path | Mapping[str, Any] | ClusterProfile) -> ClusterProfile:
    """A cluster profile by built-in name, "local", a JSON/YAML file, or a dict.

    Raises:
        ConfigError: unknown name (lists the valid ones), unreadable file, missing or
            negative fields (named), or "local" before ``graphopt calibrate`` ran.
    """
    if isinstance(spec, ClusterProfile):
        return spec
    if isinstance(spec, Mapping):
        return cluster_from_dict(spec)
    text = str(spec)
    key = text.lower()
    if key in CLUSTERS:
        return CLUSTERS[key]
    if key == "local":
        path = local_profile_path()
        if not path.exists():
            raise ConfigError(f"profile 'local' has not been measured yet ({path} is missing);"
                              " run `graphopt calibrate` first")
        try:
            return load_profile(path)
        except ConfigError as exc:  # an interrupted calibrate, a hand edit
            raise ConfigError(f"the 'local' profile (the default once `graphopt calibrate` "
                              f"ran) is unusable: {exc}; run `graphopt calibrate` again or "
                              f"delete {path}") from exc
    path = Path(text)
    if path.suffix in (".json", ".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"profile file {path} does not exist")
        try:
            raw = path.read_text()
        except OSError as exc:  # a directory, no permission
            raise ConfigError(f"cannot read the profile file {path} ({exc.strerror})") from exc
        if path.suffix == ".json":
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"profile file {path} is not valid JSON: {exc}") from exc
        else:
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError as exc:
                raise ConfigError("reading a YAML profile needs PyYAML (pip install pyyaml);"
                                  " or use JSON") from exc
            try:
                data = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise ConfigError(f"profile file {path} is not valid YAML: {exc}") from exc
        return cluster_from_dict(data)
    raise ConfigError(f"unknown profile {text!r}; valid names: {', '.join(profile_names())}, "
                      "or a .json/.yaml file")


def _require(data: Mapping[str, Any], keys: list[str], what: str,
             optional: tuple[str, ...] = ()) -> None:
    """``data`` is a mapping with ``keys`` and nothing but them and ``optional`` (a typo'd
    field was ignored: a review)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a mapping, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    unknown = sorted(set(data) - set(keys) - set(optional))
    if missing:  # a typo is both: name the unknown field too ("bandwith", a review)
        raise ConfigError(f"{what} is missing field(s) {', '.join(missing)}" + (
            f" and has unknown field(s) {', '.join(map(str, unknown))}" if unknown else ""))
    if unknown:
        raise ConfigError(f"{what} has unknown field(s) {', '.join(map(str, unknown))}; "
                          f"valid: {', '.join([*keys, *optional])}")


def cluster_from_dict(data: Mapping[str, Any]) -> ClusterProfile:
    """Inverse of :func:`cluster_to_dict`; validates every field."""
    _require(data, ["name", "device", "levels"], "cluster profile", ("source",))
    if not isinstance(data["name"], str):
        raise ConfigError(f"cluster profile name must be a string, got {data['name']!r}")
    dev = data["device"]
    if isinstance(dev, str):
        if dev.lower() not in DEVICES:
            raise ConfigError(f"unknown device {dev!r}; valid: {', '.join(DEVICES)}")
        device = DEVICES[dev.lower()]
    else:
        required = ["name", "peak_flops", "memory_bytes", "memory_bandwidth"]
        _require(dev, required, "device", tuple(sorted(
            f.name for f in fields(DeviceProfile) if f.name not in required)))
        device = DeviceProfile(**dev)
    levels = []
    if not isinstance(data["levels"], (list, tuple)):
        raise ConfigError("cluster profile levels must be a list of {name, size, link}, "
                          f"innermost first; got {data['levels']!r}")
    for i, lv in enumerate(data["levels"]):
        _require(lv, ["name", "size", "link"], f"levels[{i}]")
        _require(lv["link"], ["bandwidth", "latency"], f"levels[{i}].link")
        levels.append(ClusterLevel(lv["name"], lv["size"], LinkProfile(
            lv["link"]["bandwidth"], lv["link"]["latency"])))
    if not levels:
        raise ConfigError("cluster profile needs at least one level (devices per node)")
    return ClusterProfile(data["name"], device, tuple(levels), data.get("source", ""))


def cluster_to_dict(profile: ClusterProfile) -> dict[str, Any]:
    """A JSON-ready dict (units: FLOP/s, bytes, bytes/s, s) that :func:`cluster_from_dict`
    reads back to an equal profile."""
    out = asdict(profile)
    out["device"]["peak_flops"] = dict(profile.device.peak_flops)
    return out


__all__ = ["CLUSTERS", "DEFAULT_PROFILE", "DEVICES", "ClusterLevel", "ClusterProfile",
           "DeviceProfile", "LinkProfile", "ProfileWarning", "cluster_from_dict",
           "cluster_to_dict",
           "default_profile_name", "load_profile", "local_profile_path", "profile_names"]
