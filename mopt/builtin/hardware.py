"""Built-in hardware profiles.

Facts checked 2026-11 against the vendors' data sheets (links per profile) and
../shared/DOMAIN.md. Compute capability from https://developer.nvidia.com/cuda-gpus.
Least certain: RTX 4090 bandwidth, RTX 5070 Laptop bandwidth, B200 usable memory.
`memory_gb` is what the GPU reports (nvidia-smi's MiB / 1024, rounded); `mopt check` reads it
as GiB. `gpu_name` is nvidia-smi's name, used by `mopt doctor` to match this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import HardwareProfile, hookimpl

PROFILES = [
    HardwareProfile(
        name="cpu",
        description="Any x86-64/aarch64 CPU machine (no GPU); ONNX Runtime / PyTorch CPU",
        device="cpu",
        gpu_count=0,
        source="-",
    ),
    # AD107 laptop part: 3072 CUDA cores = 24 SMs, 128-bit GDDR6 at 16 Gbps = 256 GB/s.
    HardwareProfile(
        name="rtx4060-laptop",
        description="NVIDIA GeForce RTX 4060 Laptop GPU (Ada, AD107)",
        gpu_name="NVIDIA GeForce RTX 4060 Laptop GPU",
        compute_capability=(8, 9),
        memory_gb=8,
        bandwidth_gbps=256,
        sm_count=24,
        source="https://www.nvidia.com/en-us/geforce/laptops/40-series/",
    ),
    # AD102: 128 SMs, 24 GB GDDR6X at 21 Gbps on 384 bits = 1008 GB/s.
    HardwareProfile(
        name="rtx4090",
        description="NVIDIA GeForce RTX 4090 (Ada, AD102)",
        gpu_name="NVIDIA GeForce RTX 4090",
        compute_capability=(8, 9),
        memory_gb=24,
        bandwidth_gbps=1008,
        sm_count=128,
        fp16_tflops=165.2,
        source="https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    ),
    # GB206 laptop part: 36 SMs, 128-bit GDDR7 at 24 Gbps = 384 GB/s; sm_120.
    HardwareProfile(
        name="rtx5070-laptop",
        description="NVIDIA GeForce RTX 5070 Laptop GPU (Blackwell, GB206)",
        gpu_name="NVIDIA GeForce RTX 5070 Laptop GPU",
        compute_capability=(12, 0),
        memory_gb=8,
        bandwidth_gbps=384,
        sm_count=36,
        source="https://www.nvidia.com/en-us/geforce/laptops/50-series/",
    ),
    HardwareProfile(
        name="a10",
        description="NVIDIA A10 (Ampere, GA102)",
        gpu_name="NVIDIA A10",
        compute_capability=(8, 6),
        memory_gb=24,
        bandwidth_gbps=600,
        sm_count=72,
        fp16_tflops=125,
        source="https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
    ),
    HardwareProfile(
        name="l40s",
        description="NVIDIA L40S (Ada, AD102)",
        gpu_name="NVIDIA L40S",
        compute_capability=(8, 9),
        memory_gb=48,
        bandwidth_gbps=864,
        sm_count=142,
        fp16_tflops=362,
        source="https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    HardwareProfile(
        name="a100-80gb",
        description="NVIDIA A100 80GB SXM (Ampere, GA100)",
        gpu_name="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),
        memory_gb=80,
        bandwidth_gbps=2039,
        sm_count=108,
        fp16_tflops=312,
        source="https://www.nvidia.com/en-us/data-center/a100/",
    ),
    HardwareProfile(
        name="h100-sxm",
        description="NVIDIA H100 SXM5 80GB (Hopper, GH100)",
        gpu_name="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        memory_gb=80,
        bandwidth_gbps=3350,
        sm_count=132,
        fp16_tflops=989,
        source="https://www.nvidia.com/en-us/data-center/h100/",
    ),
    # nvidia-smi on the H200 machine here (2026-11): "NVIDIA H200, 9.0, 143771 MiB" (140.4 GiB;
    # `mopt check` reads memory_gb as GiB), driver 580.159.04.
    HardwareProfile(
        name="h200",
        description="NVIDIA H200 SXM 141GB (Hopper, GH100)",
        gpu_name="NVIDIA H200",
        compute_capability=(9, 0),
        memory_gb=141,
        bandwidth_gbps=4800,
        sm_count=132,
        fp16_tflops=989,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
    # 192 GB HBM3e physical; DGX B200 lists 1,440 GB for 8 GPUs = 180 GB usable each.
    HardwareProfile(
        name="b200",
        description="NVIDIA B200 (Blackwell, GB100)",
        gpu_name="NVIDIA B200",
        compute_capability=(10, 0),
        memory_gb=180,
        bandwidth_gbps=8000,
        sm_count=148,
        fp16_tflops=2250,
        source="https://www.nvidia.com/en-us/data-center/dgx-b200/",
    ),
]


@hookimpl
def mopt_register_hardware(register: Callable[[Any], None]) -> None:
    """The built-in profiles."""
    for profile in PROFILES:
        register(profile)
