"""Where a KV pool lives: kv dtype names as torch dtypes, the device to put it on, its free memory, and its name
in reports."""

from __future__ import annotations

import math
import mmap
import os
import platform
import re

import torch

from kvsim.errors import KvsimError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "int8": torch.int8,
}
if hasattr(torch, "float8_e4m3fn"):
    TORCH_DTYPES.update(fp8=torch.float8_e4m3fn, fp8_e4m3=torch.float8_e4m3fn, fp8_e5m2=torch.float8_e5m2)


def resolve_device(device: str, field: str = "device") -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is a user error (naming `field`)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise KvsimError(f"unknown device {device!r} (choose cpu, cuda, cuda:N or auto)", field=field) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvsimError("device 'cuda' requested but torch sees no CUDA device (use cpu or auto)", field=field)
    if dev.type not in ("cpu", "cuda"):
        raise KvsimError(f"unsupported device {device!r} (choose cpu, cuda, cuda:N or auto)", field=field)
    return dev


def free_memory_bytes(device: torch.device) -> int:
    """Bytes the pool may take: CUDA free memory, or the host's available RAM (MemAvailable) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def zeros_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for a KV pool. On the CPU it is anonymous memory advised into transparent huge pages
    (Linux, `madvise` mode): a pool's writes scatter 1-4 KiB token rows across 100+ MiB, and with 4 KiB pages
    nearly every row costs a TLB miss; with 2 MiB pages the scatter moved 25-40% more bytes per second
    (`scripts/bench_main_job.py`). Elsewhere, or where the kernel gives no huge pages, it is plain zeros.
    """
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < 2**21 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled by the kernel
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel: 4 KiB pages, same contents
        pass
    # frombuffer keeps `buffer` alive as long as any view of the tensor lives.
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def device_name(device: torch.device) -> str:
    """The device as reports name it: the CUDA device's name, or the host processor for 'cpu'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def slugify(name: str) -> str:
    """A file-name-safe device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_slug(device: torch.device) -> str:
    """`slugify` of the CUDA device's name, or 'cpu'."""
    return slugify(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"
