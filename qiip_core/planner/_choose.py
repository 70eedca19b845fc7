"""Which estimator plans a model: the one rule every planning caller follows.

The Python estimator rebuilds llama.cpp's memory for the architectures it models, exactly to what llama-server
logs; `llama-fit-params` sizes 512 logit rows instead of one per slot and one sliding window instead of one per
slot, so it is the authority only for the architectures we do not model. A caller that cannot run it (it is not
installed, or the caller runs no program) gets the refusal that says how to install it, before any candidate is
estimated.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from qiip_core._errors import PlanError
from qiip_core.planner._compute import is_modelled
from qiip_core.planner._estimate import PythonEstimator
from qiip_core.planner._fitparams import FitParamsEstimator

if TYPE_CHECKING:
    from qiip_core.planner._estimate import Estimator
    from qiip_core.planner._shape import ModelShape

__all__ = ["choose_estimator"]


def choose_estimator(
    shape: ModelShape,
    model_path: Path | None = None,
    *,
    fit_params: Path | Callable[[], Path | None] | None = None,
    embeddings: bool = False,
) -> Estimator:
    """The estimator that plans `shape`: `PythonEstimator` for an architecture it models (`is_modelled`), else
    `FitParamsEstimator` over `model_path`.

    Args:
        shape: the model (`ModelShape.from_metadata`).
        model_path: the GGUF file llama-fit-params reads (the first shard of a split family); None when the
            caller never runs it.
        fit_params: the `llama-fit-params` program (`InstalledEngine.fit_params`), or a function that finds it
            (called only for an architecture the Python estimator does not model, so a caller looks its install
            up only then); None when it is not installed or the caller runs no program.
        embeddings: the server runs with `--embeddings` (`PythonEstimator.embeddings`; an encoder is planned for
            embeddings whatever this says).

    Returns:
        The estimator to give `plan(…, estimator=…)`.

    Raises:
        PlanError: the architecture is not modelled and llama-fit-params is not available (the message says how
            to install it).
    """
    if is_modelled(shape):
        return PythonEstimator(embeddings=embeddings)
    binary = fit_params() if callable(fit_params) else fit_params
    if binary is None or model_path is None:
        raise PlanError(
            f"The memory of architecture {shape.architecture!r} is not modelled by the Python estimator; install "
            "llama-fit-params next to llama-server (qiip engine install llama.cpp) to plan it."
        )
    return FitParamsEstimator(binary, model_path)
