"""Stage 1: what machine is this? Detect GPUs/CPU/disk/software, or load a named or saved profile."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import re
import shutil
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import UserError, catalog_dir
from .quoting import comment_text, host_problem, port_problem
from .schema import raise_problems, unknown_keys

# Dense 16-bit tensor-core peak (TFLOP/s) by GPU name fragment; used when detecting a real card.
_PEAK_TFLOPS = [
    ("H200", 989.0, 4.8),
    ("H100", 989.0, 3.35),
    ("A100", 312.0, 2.0),
    ("A40", 149.7, 0.696),
    ("A6000", 154.8, 0.768),
    ("L40", 181.0, 0.864),
    ("A10", 125.0, 0.6),
    ("V100", 125.0, 0.9),
    ("T4", 65.0, 0.32),
    ("4090", 165.2, 1.0),
    ("3090", 71.0, 0.936),
]

CUDA_CONTEXT_GIB = 0.55
SOFTWARE = [
    "llamafactory",
    "transformers",
    "torch",
    "deepspeed",
    "liger-kernel",
    "flash-attn",
    "peft",
    "trl",
    "accelerate",
    "datasets",
]


@dataclass(frozen=True)
class GPUSpec:
    name: str
    vram_gib: float  # usable total memory per GPU
    compute_capability: str  # "8.0"
    peak_tflops_16bit: float = 0.0
    hbm_tbps: float = 0.0
    host_link_gbs: float = 0.0  # GPU <-> host copy rate, GB/s (PCIe gen3 x16 ~12, gen4 ~24, gen5 ~48); 0: unknown

    @property
    def cc(self) -> tuple[int, int]:
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def runs_triton(self) -> bool:
        """Triton (liger-kernel's kernels) supports sm80+ GPUs (its README); lfa plans no liger below."""
        return self.cc >= (8, 0)

    @property
    def bf16(self) -> bool:
        # transformers' own check passes on Volta/Turing through emulation; lfa decides from the capability.
        return self.cc >= (8, 0)


@dataclass(frozen=True)
class DiskSpec:
    """A local disk that DeepSpeed can swap model states to (NVMe offload)."""

    path: str  # the folder the swap files go under (nvme_path); must exist where training runs
    free_gib: float
    read_gbs: float = 0.0  # sequential O_DIRECT read, GB/s; 0: unknown
    write_gbs: float = 0.0
    rotational: bool = False  # a spinning disk: lfa does not offload to it
    source: str = ""  # where the figures come from (measured by lfa detect --measure-disk, a datasheet, ...)

    @property
    def known_rates(self) -> bool:
        return self.read_gbs > 0 and self.write_gbs > 0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPUSpec | None
    interconnect: str = "none"  # nvlink | pcie | none
    cpu_cores: int = 1
    ram_gib: float = 0.0
    description: str = ""
    processes_per_node: int = 1  # training processes per node on a machine without GPUs (gloo)
    master_addr: str | None = None  # node 0's address, fixed for multi-node rendezvous
    master_port: int = 29500
    hosts: tuple[str, ...] = ()  # optional: host name of each node, in rank order
    disk: DiskSpec | None = None  # the disk NVMe offload may swap to; None: lfa plans no disk offload
    internode_gbs: float = 0.0  # network between nodes per node, GB/s (400 Gb/s InfiniBand: 50); 0: unknown

    @property
    def world_size(self) -> int:
        per_node = self.gpus_per_node if self.has_gpu else self.processes_per_node
        return max(1, self.nodes * per_node)

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.gpus_per_node > 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def profile_from_dict(data: dict, source: str = "<dict>") -> HardwareProfile:
    if not isinstance(data, dict):
        raise UserError(f"hardware profile {source} is not a mapping of keys")
    gpu, disk = data.get("gpu"), data.get("disk")
    raise_problems(
        unknown_keys(data, [f.name for f in dataclasses.fields(HardwareProfile)])
        + (unknown_keys(gpu, [f.name for f in dataclasses.fields(GPUSpec)], "gpu.") if isinstance(gpu, dict) else [])
        + (
            unknown_keys(disk, [f.name for f in dataclasses.fields(DiskSpec)], "disk.")
            if isinstance(disk, dict)
            else []
        ),
        f"hardware profile {source}",
    )
    raise_problems(rendezvous_problems(data) + figure_problems(data), f"hardware profile {source}")
    try:
        gpu_spec = GPUSpec(**gpu) if gpu else None
        disk_spec = _disk_from_dict(disk) if disk else None
        if gpu_spec is not None:
            _ = gpu_spec.cc  # validates "X.Y"
        return HardwareProfile(
            name=str(data.get("name", Path(source).stem)),
            nodes=int(data.get("nodes", 1)),
            gpus_per_node=int(data.get("gpus_per_node", 1 if gpu_spec else 0)),
            gpu=gpu_spec,
            interconnect=str(data.get("interconnect", "none")),
            cpu_cores=int(data.get("cpu_cores", 1)),
            ram_gib=float(data.get("ram_gib", 0.0)),
            description=str(data.get("description", "")),
            processes_per_node=int(data.get("processes_per_node", 1)),
            master_addr=str(data["master_addr"]) if data.get("master_addr") else None,
            master_port=int(data.get("master_port", 29500)),
            hosts=tuple(str(h) for h in data.get("hosts") or ()),
            disk=disk_spec,
            internode_gbs=float(data.get("internode_gbs", 0.0)),
        )
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise UserError(f"hardware profile {source} is not valid: {exc!r}") from None


def _number_problem(value, at_least: float, above: bool = False) -> str | None:
    if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+[eE][-+]?[0-9]+", value.strip()):
        return f"is the text '{value}': YAML reads an exponent without a dot as text (write {float(value):.1e})"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"is {comment_text(repr(value))[:40]}: expected a number"
    if value < at_least or (above and value == at_least):
        return f"is {value:g}: expected {'more than' if above else 'at least'} {at_least:g}"
    return None


# the figures a profile file gives, each with its least value: (where, key, least, strictly above)
PROFILE_FIGURES = (
    ("", "nodes", 1, False),
    ("", "gpus_per_node", 0, False),
    ("", "cpu_cores", 1, False),
    ("", "ram_gib", 0, False),
    ("", "processes_per_node", 1, False),
    ("", "internode_gbs", 0, False),
    ("gpu.", "vram_gib", 0, True),
    ("gpu.", "peak_tflops_16bit", 0, False),
    ("gpu.", "hbm_tbps", 0, False),
    ("gpu.", "host_link_gbs", 0, False),
    ("disk.", "free_gib", 0, False),
    ("disk.", "read_gbs", 0, False),
    ("disk.", "write_gbs", 0, False),
)


def figure_problems(data: dict) -> list[str]:
    """Pure: the profile's figures that are no number, not finite or out of range (a YAML 1e9 is a string)."""
    problems = []
    for where, key, least, above in PROFILE_FIGURES:
        section = data.get(where.rstrip(".")) if where else data
        if isinstance(section, dict) and key in section:
            if problem := _number_problem(section[key], least, above):
                problems.append(f"{where}{key} {problem}")
    return problems


INTERCONNECTS = ("nvlink", "pcie", "none")


def rendezvous_problems(data: dict) -> list[str]:
    """The profile's values that reach launch scripts as names: host names and addresses, the port, the link."""
    problems = []
    if data.get("master_addr") and (problem := host_problem(data["master_addr"])):
        problems.append(f"master_addr {problem}")
    hosts = data.get("hosts") or []
    if not isinstance(hosts, list):
        problems.append("hosts must be a list of host names, one per node in rank order")
    else:
        problems += [f"hosts[{i}] {problem}" for i, host in enumerate(hosts) if (problem := host_problem(host))]
    if "master_port" in data and (problem := port_problem(data["master_port"])):
        problems.append(f"master_port {problem}")
    if str(data.get("interconnect", "none")) not in INTERCONNECTS:
        problems.append(
            f"interconnect '{comment_text(data['interconnect'])[:80]}' is not one of {', '.join(INTERCONNECTS)}"
        )
    return problems


def _disk_from_dict(disk: dict) -> DiskSpec:
    if not isinstance(disk, dict) or "path" not in disk or "free_gib" not in disk:
        raise ValueError("disk needs at least path and free_gib")
    spec = DiskSpec(
        path=str(disk["path"]),
        free_gib=float(disk["free_gib"]),
        read_gbs=float(disk.get("read_gbs", 0.0)),
        write_gbs=float(disk.get("write_gbs", 0.0)),
        rotational=bool(disk.get("rotational", False)),
        source=str(disk.get("source", "")),
    )
    if min(spec.free_gib, spec.read_gbs, spec.write_gbs) < 0:
        raise ValueError("disk figures must not be negative")
    return spec


def builtin_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted((catalog_dir() / "hardware").glob("*.yaml"))}


def load_profile(name_or_path: str) -> HardwareProfile:
    """A built-in name (v100-32g, h200, cpu, ...), a saved profile file (yaml/json), or 'detect'."""
    if name_or_path == "detect":
        return detect().profile
    path = builtin_profiles().get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        names = ", ".join(builtin_profiles())
        raise UserError(f"no hardware profile '{name_or_path}': not a file and not one of: {names}, detect")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read hardware profile {path}: {comment_text(exc)}") from None
    if not isinstance(data, dict):
        raise UserError(f"hardware profile {path} must be a mapping, got {type(data).__name__}")
    return profile_from_dict(data.get("profile", data), str(path))


@dataclass
class DetectReport:
    profile: HardwareProfile
    gpus: list[dict] = field(default_factory=list)  # per-GPU details: free memory, NVLink links
    disk_free_gib: float = 0.0
    software: dict[str, str | None] = field(default_factory=dict)
    hub: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    disks: list[dict] = field(default_factory=list)  # LocalDisk records: every writable local disk

    def to_dict(self) -> dict:
        return {
            "profile": self.profile.to_dict(),
            "gpus": self.gpus,
            "disk_free_gib": self.disk_free_gib,
            "disks": self.disks,
            "software": self.software,
            "hub": self.hub,
            "notes": self.notes,
        }


def _nvml_gpus() -> tuple[list[dict], str | None]:
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver: a CPU machine
        return [], f"NVML not available ({exc.__class__.__name__}): no NVIDIA driver"
    gpus = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    links += int(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
                except Exception:
                    break
            gpus.append(
                {
                    "index": index,
                    "name": name,
                    "total_gib": round(mem.total / 2**30, 2),
                    "free_gib": round(mem.free / 2**30, 2),
                    "compute_capability": f"{major}.{minor}",
                    "bf16": (major, minor) >= (8, 0),
                    "fp16": (major, minor) >= (5, 3),
                    "nvlink_links": links,
                }
            )
    finally:
        pynvml.nvmlShutdown()
    return gpus, None


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def installed_versions(names=SOFTWARE) -> dict[str, str | None]:
    versions = {}
    for dist in names:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


# packages whose version LLaMA-Factory pins a range for (its import-time check, else its requirements, say which)
LF_RANGED = ("transformers", "trl", "accelerate", "peft", "datasets")
# LLaMA-Factory's own check at import: check_dependencies() in llamafactory/extras/misc.py
LF_RUNTIME_CHECK = re.compile(r'check_version\(\s*"([A-Za-z0-9_.-]+)([^"]*)"\s*\)')


def llamafactory_runtime_ranges() -> dict[str, str]:
    """The version ranges the installed LLaMA-Factory checks when it is imported (wider than its wheel's metadata
    for some packages), read from its source without importing it; {} where they cannot be found."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llamafactory")
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    misc = Path(next(iter(spec.submodule_search_locations))) / "extras" / "misc.py"
    try:
        source = misc.read_text()
    except OSError:
        return {}
    body = source.partition("def check_dependencies")[2].partition("\ndef ")[0]
    return {name.lower(): versions for name, versions in LF_RUNTIME_CHECK.findall(body) if name.lower() in LF_RANGED}


SOFTWARE_PAIR_KEYS = ("package", "versions", "llamafactory", "why", "fix")


def software_pairs() -> list[dict]:
    """catalog/software_pairs.yaml, strictly: every entry has exactly SOFTWARE_PAIR_KEYS."""
    path = catalog_dir() / "software_pairs.yaml"
    pairs = yaml.safe_load(path.read_text()) or []
    problems = []
    for i, pair in enumerate(pairs):
        problems += unknown_keys(pair, SOFTWARE_PAIR_KEYS, f"entry {i + 1}: ")
        problems += [f"entry {i + 1}: `{key}` is missing" for key in SOFTWARE_PAIR_KEYS if key not in pair]
    raise_problems(problems, str(path))
    return pairs


def stack_problems(
    versions: dict[str, str | None], llamafactory_requires: list[str], runtime_ranges: dict[str, str] | None = None
) -> list[str]:
    """Known-bad combinations in an installed stack, each with its fix. versions: package -> version (None when
    absent), numpy and pyarrow included; llamafactory_requires: the installed LLaMA-Factory's requirement lines;
    runtime_ranges: what it checks at import (llamafactory_runtime_ranges), which decides where it is known."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    def parsed(name: str):
        try:
            return Version(versions[name]) if versions.get(name) else None
        except InvalidVersion:
            return None

    problems = []
    numpy, pyarrow = parsed("numpy"), parsed("pyarrow")
    if numpy and pyarrow and numpy.major < 2 and pyarrow.major >= 21:
        problems.append(
            f"numpy {numpy} with pyarrow {pyarrow}: pyarrow 21+ is built for numpy 2, so `datasets` (and "
            "LLaMA-Factory's data loading) fails to import; fix: pip install 'pyarrow<21'"
        )
    lf = versions.get("llamafactory")
    ranges = {}
    for line in llamafactory_requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is None or "extra" not in str(requirement.marker):
            ranges[requirement.name.lower()] = (requirement.specifier, "range")
    for name, spec in (runtime_ranges or {}).items():
        try:
            ranges[name] = (SpecifierSet(spec), "import-time check")
        except ValueError:
            continue
    for name in LF_RANGED:
        installed = parsed(name)
        specifier, source = ranges.get(name, (None, ""))
        if installed is not None and specifier and not specifier.contains(installed, prereleases=True):
            problems.append(
                f"{name} {installed} is outside LLaMA-Factory {lf}'s {source} ({specifier}): untested pairs "
                f"break in training; fix: pip install '{name}{specifier}'"
            )
    lf_version = parsed("llamafactory")
    for pair in software_pairs():
        installed = parsed(pair["package"])
        if installed is None or lf_version is None:
            continue
        lf_release = Version(lf_version.base_version)  # 0.9.5.dev0 is the 0.9.5 line
        if SpecifierSet(pair["versions"]).contains(installed, prereleases=True) and SpecifierSet(
            pair["llamafactory"]
        ).contains(lf_release, prereleases=True):
            problems.append(f"{pair['package']} {installed} with LLaMA-Factory {lf}: {pair['why']}; fix: {pair['fix']}")
    return problems


def installed_stack_problems() -> list[str]:
    versions = installed_versions([*SOFTWARE, "numpy", "pyarrow"])
    try:
        requires = importlib.metadata.requires("llamafactory") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    return stack_problems(versions, requires, llamafactory_runtime_ranges())


def hub_status(check_network: bool = True, timeout_s: float = 2.0) -> dict:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    status = {
        "HF_ENDPOINT": os.environ.get("HF_ENDPOINT"),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
        "endpoint": endpoint,
        "reachable": None,
    }
    if check_network:
        url = urllib.parse.urlparse(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            status["reachable"] = True
        except OSError as exc:
            status["reachable"] = False
            status["error"] = f"{exc.__class__.__name__}: {exc}"
    return status


def gpu_spec_from_nvml(info: dict) -> GPUSpec:
    peak, hbm = 0.0, 0.0
    for fragment, tflops, tbps in _PEAK_TFLOPS:
        if fragment in info["name"]:
            peak, hbm = tflops, tbps
            break
    # usable = total minus the CUDA context every process pays outside PyTorch's allocator
    return GPUSpec(
        name=info["name"],
        vram_gib=round(info["total_gib"] - CUDA_CONTEXT_GIB, 2),
        compute_capability=info["compute_capability"],
        peak_tflops_16bit=peak,
        hbm_tbps=hbm,
    )


# file systems that are not a local disk (memory, network, containers' layers)
NOT_A_DISK = {
    "tmpfs",
    "devtmpfs",
    "ramfs",
    "overlay",
    "squashfs",
    "proc",
    "sysfs",
    "cgroup",
    "cgroup2",
    "nfs",
    "nfs4",
    "cifs",
    "smbfs",
    "fuse.sshfs",
    "autofs",
    "devpts",
    "mqueue",
    "debugfs",
    "tracefs",
    "securityfs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "binfmt_misc",
    "efivarfs",
    "nsfs",
}


@dataclass(frozen=True)
class LocalDisk:
    device: str
    mountpoint: str
    fstype: str
    free_gib: float
    rotational: bool | None  # None: the kernel does not say


def _rotational(device: str) -> bool | None:
    """/sys/block/<disk>/queue/rotational for /dev/<disk> or one of its partitions."""
    name = Path(device).name
    for candidate in (name, name.rstrip("0123456789"), re.sub(r"p\d+$", "", name)):
        flag = Path("/sys/block") / candidate / "queue" / "rotational"
        if flag.is_file():
            try:
                return flag.read_text().strip() == "1"
            except OSError:
                return None
    return None


def local_disks(mounts_file: str = "/proc/mounts") -> list[LocalDisk]:
    """Writable local disks from the mount table, most free space first (one entry per device)."""
    try:
        lines = Path(mounts_file).read_text().splitlines()
    except OSError:
        return []
    disks: dict[str, LocalDisk] = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[2] in NOT_A_DISK or not fields[0].startswith("/dev/"):
            continue
        device, mountpoint, fstype, options = fields[0], fields[1].replace("\\040", " "), fields[2], fields[3]
        if "ro" in options.split(",") or not os.access(mountpoint, os.W_OK):
            continue
        try:
            free = shutil.disk_usage(mountpoint).free / 2**30
        except OSError:
            continue
        if device not in disks or len(mountpoint) < len(disks[device].mountpoint):
            disks[device] = LocalDisk(device, mountpoint, fstype, round(free, 1), _rotational(device))
    return sorted(disks.values(), key=lambda d: -d.free_gib)


def swap_folder_for(disk: LocalDisk, cwd: Path | None = None) -> str:
    """Where NVMe offload should swap on this disk: the current folder when it lives there, else the mount point."""
    cwd = (cwd or Path.cwd()).resolve()
    try:
        if os.stat(cwd).st_dev == os.stat(disk.mountpoint).st_dev:
            return str(cwd)
    except OSError:
        pass
    return disk.mountpoint


def nearest_existing(path: Path) -> Path:
    """The path itself, or the nearest folder above it that exists (where a folder yet to be made will live)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def measure_disk(folder: str, size_mib: int = 1024, block_mib: int = 1) -> tuple[float, float]:
    """Sequential (write, read) GB/s with O_DIRECT (no page cache) through a file in a temporary folder lfa
    creates under `folder` and removes. UserError when the file system refuses O_DIRECT (tmpfs, some overlays)."""
    import mmap
    import tempfile
    import time

    if not hasattr(os, "O_DIRECT"):
        raise UserError("this platform has no O_DIRECT: the disk cannot be measured without the page cache")
    block = block_mib * 2**20
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(block))
    blocks = max(1, size_mib // block_mib)
    scratch = tempfile.mkdtemp(prefix="lfa-disk-test-", dir=folder)
    path = os.path.join(scratch, "probe.bin")
    try:
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        except OSError as exc:
            raise UserError(f"cannot measure {folder}: O_DIRECT refused ({exc.strerror})") from None
        try:
            start = time.perf_counter()
            for _ in range(blocks):
                os.write(fd, buffer)
            os.fsync(fd)
            write_s = time.perf_counter() - start
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            start = time.perf_counter()
            while os.readv(fd, [buffer]) > 0:
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    except OSError as exc:
        raise UserError(f"cannot measure {folder}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total = blocks * block
    return total / write_s / 1e9, total / read_s / 1e9


FAST_DISK_GBS = 0.5  # sustained O_DIRECT rate no spinning disk reaches


def choose_swap_disk(disks: list[LocalDisk], measure: bool) -> tuple[DiskSpec | None, list[str]]:
    """The disk NVMe offload should use: the solid-state one with most free space. Virtual disks often call
    themselves rotational; a measured rate above FAST_DISK_GBS settles it."""
    notes = []
    candidates = [d for d in disks if d.rotational is not True] or (disks if measure else [])
    if not candidates:
        if disks:
            notes.append(
                "the kernel calls every local disk rotational: lfa plans no NVMe offload to them "
                "(virtual disks often say so; `lfa detect --measure-disk` measures them)"
            )
        return None, notes
    best = candidates[0]
    folder = swap_folder_for(best)
    if not measure:
        return DiskSpec(
            path=folder,
            free_gib=best.free_gib,
            source=f"lfa detect: {best.device} ({best.fstype}); rates not measured (lfa detect --measure-disk)",
        ), notes
    write, read = measure_disk(folder)
    if best.rotational and min(read, write) < FAST_DISK_GBS:
        notes.append(
            f"{best.device} is rotational and measured {write:.2f} GB/s write, {read:.2f} GB/s read: "
            "lfa plans no NVMe offload to it"
        )
        return None, notes
    return DiskSpec(
        path=folder,
        free_gib=best.free_gib,
        read_gbs=round(read, 2),
        write_gbs=round(write, 2),
        source=f"measured by lfa detect --measure-disk in {folder} ({best.device}, 1 GiB, O_DIRECT, 1 MiB blocks)",
    ), notes


def detect(check_network: bool = True, disk_path: str = ".", measure: bool = False) -> DetectReport:
    gpus, note = _nvml_gpus()
    notes = [note] if note else []
    if gpus:
        names = {g["name"] for g in gpus}
        if len(names) > 1:
            notes.append(f"mixed GPU models {sorted(names)}: planning for the smallest")
        smallest = min(gpus, key=lambda g: g["total_gib"])
        nvlink = all(g["nvlink_links"] > 0 for g in gpus) and len(gpus) > 1
        profile = HardwareProfile(
            name="detected",
            nodes=1,
            gpus_per_node=len(gpus),
            gpu=gpu_spec_from_nvml(smallest),
            interconnect="nvlink" if nvlink else ("pcie" if len(gpus) > 1 else "none"),
            cpu_cores=os.cpu_count() or 1,
            ram_gib=round(_ram_gib(), 1),
            description=f"{len(gpus)}x {smallest['name']}",
        )
    else:
        notes.append("no GPU found: reporting the CPU; recipes will train in fp32 on the CPU")
        profile = HardwareProfile(
            name="detected",
            nodes=1,
            gpus_per_node=0,
            gpu=None,
            cpu_cores=os.cpu_count() or 1,
            ram_gib=round(_ram_gib(), 1),
            description="CPU only",
        )
    try:
        disk_free = shutil.disk_usage(disk_path).free / 2**30
    except OSError:
        disk_free = 0.0
    notes += [f"known-bad pair: {problem}" for problem in installed_stack_problems()]
    disks = local_disks()
    disk, disk_notes = choose_swap_disk(disks, measure)
    notes += disk_notes
    if disk is not None:
        profile = dataclasses.replace(profile, disk=disk)
    return DetectReport(
        profile=profile,
        gpus=gpus,
        disk_free_gib=round(disk_free, 1),
        software=installed_versions(),
        hub=hub_status(check_network),
        notes=notes,
        disks=[dataclasses.asdict(d) for d in disks],
    )


def save_profile(profile: HardwareProfile, path: Path) -> None:
    path.write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
