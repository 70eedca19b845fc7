"""Shapes, devices and a predictable estimator for the planner's tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qiip_core.planner import DeviceEstimate, DeviceMemory, MemoryEstimate, ModelShape
from qiip_core.planner._types import CacheType, FlashAttn


def shape(
    *,
    n_layers: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int | None = None,
    n_ctx_train: int = 8192,
    n_vocab: int = 2000,
    weights_bytes: int = 10 << 20,
) -> ModelShape:
    """A llama-style shape; the defaults are the 4-block, 256-wide GQA test model."""
    head = head_dim if head_dim is not None else n_embd // n_head
    return ModelShape(
        architecture="llama",
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head,
        head_dim_v=head,
        n_ff=n_ff if n_ff is not None else 4 * n_embd,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        weights_bytes=weights_bytes,
    )


def cpu(free_mib: int, total_mib: int | None = None) -> DeviceMemory:
    """The CPU-mode device."""
    return DeviceMemory(index=0, name="CPU", total_mib=total_mib or max(free_mib, 1), free_mib=free_mib, kind="cpu")


def gpu(index: int, free_mib: int, total_mib: int = 81920) -> DeviceMemory:
    """An NVIDIA GPU."""
    return DeviceMemory(index=index, name=f"GPU-{index}", total_mib=total_mib, free_mib=free_mib)


@dataclass
class LinearEstimator:
    """Memory that grows linearly with the K/V cells: easy to reason about, and monotone like the real thing.

    Each device gets `shares[i]` of the model, the K/V cache and the compute.
    """

    model_mib: float = 1000.0
    kv_mib_per_token: dict[str, float] = field(default_factory=lambda: {"f16": 0.5, "q8_0": 0.265625})
    compute_mib: float = 100.0
    compute_mib_per_token: float = 0.001
    shares: tuple[float, ...] = (1.0,)
    calls: list[tuple[int, int, str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "linear"

    def total(self, aggregate: int, cache_type: str) -> float:
        return (
            self.model_mib
            + aggregate * self.kv_mib_per_token[cache_type]
            + self.compute_mib
            + aggregate * self.compute_mib_per_token
        )

    def estimate(
        self,
        shape: ModelShape,
        *,
        aggregate_context: int,
        slots: int,
        cache_type: CacheType,
        flash_attn: FlashAttn,
        devices: Sequence[DeviceMemory],
    ) -> MemoryEstimate:
        self.calls.append((aggregate_context, slots, cache_type, flash_attn))
        kv = aggregate_context * self.kv_mib_per_token[cache_type]
        compute = self.compute_mib + aggregate_context * self.compute_mib_per_token
        return MemoryEstimate(
            devices=tuple(
                DeviceEstimate(index=d.index, model_mib=self.model_mib * s, context_mib=kv * s, compute_mib=compute * s)
                for d, s in zip(devices, self.shares, strict=True)
            ),
            source=self.name,
        )
