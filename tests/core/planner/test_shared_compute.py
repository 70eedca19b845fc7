"""An estimate's compute buffer is replayed once per graph and shared: devices that split the layers alike get the
buffer their own replay gives, and devices that split them otherwise get theirs."""

from __future__ import annotations

from qiip_core.planner import DeviceMemory, estimate
from qiip_core.planner._compute import build_graph
from qiip_core.planner._estimate import CPU_ALIGNMENT, CUDA_ALIGNMENT, layer_split
from qiip_core.planner._galloc import compute_buffer_bytes
from qiip_core.planner._graph import GraphParams

from .conftest import shape


def gpus(product: str, *free_mib: int) -> tuple[DeviceMemory, ...]:
    return tuple(DeviceMemory(index=i, name=product, total_mib=90_000, free_mib=f) for i, f in enumerate(free_mib))


def replayed(devices: tuple[DeviceMemory, ...], n_layers: int) -> dict[int, int]:
    """The compute buffers of a fresh graph and allocator, nothing shared."""
    model = shape(n_layers=n_layers)
    params = GraphParams(
        aggregate_context=4096,
        slots=2,
        cache_type="f16",
        flash_attn=True,
        layer_devices=layer_split([d.free_mib for d in devices], model.total_layers),
        host=len(devices),
    )
    alignment = dict.fromkeys(range(len(devices)), CUDA_ALIGNMENT) | {len(devices): CPU_ALIGNMENT}
    return compute_buffer_bytes(build_graph(model, params), alignment=alignment, keep_copies=len(devices) > 1)


def compute(devices: tuple[DeviceMemory, ...], n_layers: int) -> list[float]:
    found = estimate(
        shape(n_layers=n_layers), aggregate_context=4096, slots=2, cache_type="f16", flash_attn="on", devices=devices
    )
    assert found.host is not None
    return [d.compute_mib for d in found.devices] + [found.host.compute_mib]


def test_gpus_that_split_the_layers_alike_share_the_buffer_their_own_replay_gives() -> None:
    h100, a100 = gpus("NVIDIA H100", 81_559, 81_559), gpus("NVIDIA A100", 81_920, 81_920)
    fresh = replayed(h100, 8)
    assert compute(h100, 8) == compute(a100, 8) == [fresh[i] / 2**20 for i in range(3)]


def test_gpus_that_split_the_layers_otherwise_get_their_own_buffers() -> None:
    even, uneven = gpus("NVIDIA L40S", 40_000, 40_000), gpus("NVIDIA L40S", 70_000, 10_000)
    for devices in (even, uneven):
        fresh = replayed(devices, 8)
        assert compute(devices, 8) == [fresh.get(i, 0) / 2**20 for i in range(3)]
    assert compute(even, 8) != compute(uneven, 8)
