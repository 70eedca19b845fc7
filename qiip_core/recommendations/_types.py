"""What a host can run well: llmfit's `recommend --json` normalised into QIIP's terms, without I/O.

llmfit 1.1.17 prints `{"system": {...}, "models": [{...}]}`, the models ranked best first. Its fields are read as it
prints them (`name`, `provider`, `runtime`, `fit_level`, `run_mode`, `score`, `estimated_tps`, `memory_required_gb`,
`memory_available_gb`, `best_quant`, `effective_context_length`, `parameter_count`, `use_case`, `gguf_sources`), and
normalised:

| llmfit | QIIP |
|---|---|
| `runtime` `vLLM` / `llama.cpp` / `MLX` (any other, such as `bitnet.cpp`) | `vllm` / `llama_cpp` / `mlx` (`unknown`) |
| `fit_level` `Perfect` / `Good` / `Marginal` / `Too Tight` | `perfect` / `good` / `marginal` / `too_tight` |
| `*_gb` (binary gigabytes: its `total_ram_gb` is `/proc/meminfo`'s KiB / 1024²) | `*_gib` |
| `estimated_tps` | `estimated_tokens_per_s` |
| `gguf_sources: [{provider, repo}]` with `best_quant` | `gguf_sources: [{repo, provider, file: None, quantization}]` |

llmfit names no file of a GGUF repository (only its quantisation), so `file` stays None: the catalog never guesses
one. `in_catalog` is true only for a repository id that is exactly a model of QIIP's catalog.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qiip_core._errors import LlmfitError
from qiip_core._violation import first_violation

__all__ = [
    "LLMFIT_VERSION",
    "FitLevel",
    "GgufSource",
    "HardwareSummary",
    "HostRecommendations",
    "Recommendation",
    "Runtime",
    "parse_recommendations",
]

LLMFIT_VERSION = "1.1.17"
"""The llmfit release QIIP runs on hosts (pinned in pyproject.toml; its wheel's digest in uv.lock)."""

Runtime = Literal["vllm", "llama_cpp", "mlx", "unknown"]
"""The engine a recommendation runs on, in QIIP's names (`unknown`: one QIIP does not run, such as bitnet.cpp)."""

FitLevel = Literal["perfect", "good", "marginal", "too_tight"]
"""How well the model fits the host's memory, best first (llmfit's `fit_level`)."""

_RUNTIMES: dict[str, Runtime] = {"vllm": "vllm", "llama.cpp": "llama_cpp", "llamacpp": "llama_cpp", "mlx": "mlx"}
"""llmfit's runtime labels (`recommend --json` prints `vLLM`, `llama.cpp`, `MLX`), case-folded → QIIP's runtimes."""

_FIT_LEVELS: dict[str, FitLevel] = {
    "perfect": "perfect",
    "good": "good",
    "marginal": "marginal",
    "too tight": "too_tight",
    "tootight": "too_tight",
}


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class GgufSource(_View):
    """A GGUF repository on the Hugging Face hub that holds the model (llmfit's `gguf_sources[]`)."""

    repo: str
    """The hub repository id, `ORG/NAME` (llmfit's `repo`)."""
    provider: str | None = None
    """Who publishes it (llmfit's `provider`, such as `unsloth` or `bartowski`)."""
    file: str | None = None
    """The GGUF file, when llmfit names one (llmfit 1.1.17 never does: it names the quantisation only)."""
    quantization: str | None = None
    """The quantisation to take from it (llmfit's `best_quant`, such as `Q8_0`), or None."""
    in_catalog: bool = False
    """True when `repo` is exactly a model of QIIP's catalog (the gateway's Hugging Face cache)."""


class Recommendation(_View):
    """One model llmfit recommends for a host, in rank order."""

    rank: int = Field(ge=1)
    """1 for llmfit's best."""
    repo: str
    """The model's hub repository id (llmfit's `name`)."""
    provider: str | None = None
    """Its publisher (llmfit's `provider`)."""
    runtime: Runtime
    """The engine llmfit scored it for, in QIIP's names."""
    runtime_label: str
    """llmfit's own name of that engine (`runtime`: `vLLM`, `llama.cpp`, `MLX`, `bitnet.cpp`, …)."""
    fit_level: FitLevel
    """How well it fits the host's memory."""
    run_mode: str
    """Where it would run, llmfit's `run_mode` (`GPU`, `CPU`, `CPU+GPU`, `MoE Offload`, …)."""
    score: float
    """llmfit's composite score, 0–100 (quality, speed, fit, context)."""
    estimated_tokens_per_s: float
    """llmfit's estimate of generation throughput, in tokens/s (`estimated_tps`)."""
    memory_required_gib: float
    """Memory the model needs at `context_tokens`, in GiB (`memory_required_gb`)."""
    memory_available_gib: float | None = None
    """Memory llmfit found for it on the host, in GiB (`memory_available_gb`)."""
    quantization: str | None = None
    """The quantisation llmfit picked (`best_quant`: a GGUF type such as `Q8_0`, or `AWQ-4bit`, `GPTQ-Int4`)."""
    context_tokens: int | None = None
    """The context the estimate assumes, in tokens (`effective_context_length`)."""
    parameter_count: str | None = None
    """The model's size as llmfit writes it (`12.6B`)."""
    use_case: str | None = None
    """What the model is for, in llmfit's words."""
    gguf_sources: tuple[GgufSource, ...] = ()
    """GGUF repositories holding the model, for llama.cpp."""
    in_catalog: bool = False
    """True when `repo` is exactly a model of QIIP's catalog."""

    @property
    def lacks_gguf(self) -> bool:
        """True for a llama.cpp recommendation with no GGUF to serve it from: llmfit names no GGUF repository
        (`gguf_sources`), the recommended repository is not one (its id does not end in `GGUF`), and the catalog
        does not hold it. QIIP can neither download nor launch it as it stands."""
        return (
            self.runtime == "llama_cpp"
            and not self.gguf_sources
            and not self.in_catalog
            and not self.repo.upper().endswith("GGUF")
        )


class HardwareSummary(_View):
    """The hardware llmfit scored against: the host's own, or the named profile's (llmfit's `system`)."""

    backend: str | None = None
    """llmfit's acceleration backend (`CUDA`, `CPU (x86)`, `Metal`, …)."""
    cpu_name: str | None = None
    cpu_cores: int | None = None
    total_ram_gib: float | None = None
    """System memory, in GiB (`total_ram_gb`)."""
    available_ram_gib: float | None = None
    """System memory free for a model, in GiB (`available_ram_gb`)."""
    gpu_count: int = 0
    gpu_name: str | None = None
    gpu_vram_gib: float | None = None
    """Memory of the GPUs, in GiB (`gpu_vram_gb`)."""
    unified_memory: bool = False
    """True when the GPU shares system memory (Apple silicon, some APUs)."""


class HostRecommendations(_View):
    """`GET /admin/nodes/{host}/recommendations`: what llmfit recommends for a host, best first."""

    host: str
    profile: str | None = None
    """The llmfit hardware profile scored against (`--profile`), or None for the host's own hardware."""
    llmfit_version: str = LLMFIT_VERSION
    system: HardwareSummary
    recommendations: tuple[Recommendation, ...]


# -- llmfit's output, as `recommend --json` prints it ---------------------------------------------------------


class _LlmfitGguf(_View):
    provider: str | None = None
    repo: str


class _LlmfitModel(_View):
    name: str
    provider: str | None = None
    runtime: str
    fit_level: str
    run_mode: str
    score: float
    estimated_tps: float
    memory_required_gb: float
    memory_available_gb: float | None = None
    best_quant: str | None = None
    effective_context_length: int | None = None
    parameter_count: str | None = None
    use_case: str | None = None
    gguf_sources: list[_LlmfitGguf] = Field(default_factory=list)


class _LlmfitSystem(_View):
    backend: str | None = None
    cpu_name: str | None = None
    cpu_cores: int | None = None
    total_ram_gb: float | None = None
    available_ram_gb: float | None = None
    gpu_count: int = 0
    gpu_name: str | None = None
    gpu_vram_gb: float | None = None
    unified_memory: bool = False


class _LlmfitOutput(_View):
    system: _LlmfitSystem
    models: list[_LlmfitModel]


def parse_recommendations(
    stdout: str, *, host: str, profile: str | None = None, catalog_repos: Collection[str] = ()
) -> HostRecommendations:
    """Normalise what `llmfit [--profile NAME] recommend --json` printed on stdout.

    Args:
        stdout: llmfit's standard output (its standard error, warnings included, is not part of it).
        host: the host it ran on.
        profile: the `--profile` it was given, if any.
        catalog_repos: the repository ids of QIIP's catalog; a recommendation or GGUF source whose repository is
            exactly one of them is `in_catalog`.

    Returns:
        The recommendations in llmfit's order, ranked from 1.

    Raises:
        LlmfitError: stdout is not JSON of `recommend --json`'s shape, or names a fit level llmfit does not have.
    """
    try:
        output = _LlmfitOutput.model_validate_json(stdout)
    except ValidationError as exc:
        error = first_violation(exc)
        raise LlmfitError(
            f"llmfit on {host} printed what `recommend --json` does not ({error.field or 'the output'}: "
            f"{error.message}).",
            host=host,
        ) from None
    in_catalog = frozenset(catalog_repos)
    items = []
    for rank, model in enumerate(output.models, start=1):
        fit = _FIT_LEVELS.get(model.fit_level.casefold())
        if fit is None:
            raise LlmfitError(
                f"llmfit on {host} gave {model.name} the fit level {model.fit_level!r}, which llmfit "
                f"{LLMFIT_VERSION} does not have.",
                host=host,
            )
        sources = tuple(
            GgufSource(repo=s.repo, provider=s.provider, quantization=model.best_quant, in_catalog=s.repo in in_catalog)
            for s in model.gguf_sources
        )
        items.append(
            Recommendation(
                rank=rank,
                repo=model.name,
                provider=model.provider,
                runtime=_RUNTIMES.get(model.runtime.casefold(), "unknown"),
                runtime_label=model.runtime,
                fit_level=fit,
                run_mode=model.run_mode,
                score=model.score,
                estimated_tokens_per_s=model.estimated_tps,
                memory_required_gib=model.memory_required_gb,
                memory_available_gib=model.memory_available_gb,
                quantization=model.best_quant,
                context_tokens=model.effective_context_length,
                parameter_count=model.parameter_count,
                use_case=model.use_case,
                gguf_sources=sources,
                in_catalog=model.name in in_catalog,
            )
        )
    s = output.system
    system = HardwareSummary(
        backend=s.backend,
        cpu_name=s.cpu_name,
        cpu_cores=s.cpu_cores,
        total_ram_gib=s.total_ram_gb,
        available_ram_gib=s.available_ram_gb,
        gpu_count=s.gpu_count,
        gpu_name=s.gpu_name,
        gpu_vram_gib=s.gpu_vram_gb,
        unified_memory=s.unified_memory,
    )
    return HostRecommendations(host=host, profile=profile, system=system, recommendations=tuple(items))
