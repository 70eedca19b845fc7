from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from qiip_core import PlanError
from qiip_core.planner import (
    FitParamsEstimator,
    FitRow,
    PythonEstimator,
    choose_estimator,
    estimate,
    parse_fit_print,
)

from .conftest import cpu, gpu, shape


def test_cpu_mode_reads_the_host_row():
    assert parse_fit_print("Host 9 16 12 \n", device_count=1, cpu_mode=True) == [FitRow("Host", 9, 16, 12)]


def test_gpu_mode_reads_the_cuda_rows_in_order_and_ignores_the_host_row():
    text = "CUDA0 4000 512 300\nCUDA1 3900 480 290\nHost 250 0 40\n"
    assert parse_fit_print(text, device_count=2, cpu_mode=False) == [
        FitRow("CUDA0", 4000, 512, 300),
        FitRow("CUDA1", 3900, 480, 290),
    ]


def test_log_noise_is_skipped():
    text = "warning: no usable GPU found\nllama_model_loader: loaded meta data\n\nHost 1 2 3\nHostname is irrelevant"
    assert parse_fit_print(text, device_count=1, cpu_mode=True) == [FitRow("Host", 1, 2, 3)]


@pytest.mark.parametrize(
    "row", ["Host 9 16", "Host 9 16 12 7", "CUDA0 9 -16 12", "Host 9.5 16 12", "CUDA0 nine 16 12", "Host"]
)
def test_a_malformed_row_is_an_error(row):
    with pytest.raises(PlanError, match="printed a row that is not '<device> <model_MiB> <context_MiB>"):
        parse_fit_print(f"{row}\nCUDA1 1 2 3\n", device_count=2, cpu_mode=False)


@pytest.mark.parametrize(
    ("text", "count", "cpu_mode", "message"),
    [
        ("CUDA0 1 2 3\nHost 1 2 3", 2, False, r"printed 1 GPU row\(s\) for 2 planned GPU\(s\)"),
        ("CUDA0 1 2 3\nCUDA1 1 2 3\nHost 1 2 3", 1, False, r"printed 2 GPU row\(s\) for 1 planned GPU\(s\)"),
        ("Host 1 2 3", 1, False, r"printed 0 GPU row\(s\)"),
        ("CUDA1 1 2 3\nCUDA0 1 2 3", 2, False, r"printed GPU rows \['CUDA1', 'CUDA0'\], expected"),
        ("", 1, True, "printed 0 Host rows; CPU mode needs exactly one"),
        ("Host 1 2 3\nHost 1 2 3", 1, True, "printed 2 Host rows"),
        ("CUDA0 1 2 3\nHost 1 2 3", 1, True, "sees 1 GPU"),
    ],
)
def test_the_rows_must_match_the_devices(text, count, cpu_mode, message):
    with pytest.raises(PlanError, match=message):
        parse_fit_print(text, device_count=count, cpu_mode=cpu_mode)


def fake_fit_params(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-fit-params"
    script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/args"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def run(estimator: FitParamsEstimator, devices, **kwargs):
    args: dict[str, Any] = {"aggregate_context": 8192, "slots": 4, "cache_type": "f16", "flash_attn": "auto"} | kwargs
    return estimator.estimate(shape(), devices=devices, **args)


def test_one_unified_pool_is_asked_for_with_parallel_1(tmp_path):
    binary = fake_fit_params(tmp_path, 'echo "Host 9 32 500"')
    result = run(FitParamsEstimator(binary, Path("/models/m.gguf")), [cpu(10000)], cache_type="q8_0", flash_attn="on")
    args = (tmp_path / "args").read_text().split()
    assert args == [
        "--model",
        "/models/m.gguf",
        "--ctx-size",
        "8192",
        "--parallel",
        "1",
        "--gpu-layers",
        "all",
        "--cache-type-k",
        "q8_0",
        "--cache-type-v",
        "q8_0",
        "--flash-attn",
        "on",
        "--fit-print",
        "on",
        "--verbosity",
        "0",
    ]
    (device,) = result.devices
    assert (device.model_mib, device.context_mib, device.compute_mib) == (9, 32, 500)
    assert result.source == "llama-fit-params" and result.flash_attn


def test_compute_is_never_below_the_exact_graph(tmp_path):
    binary = fake_fit_params(tmp_path, 'echo "CUDA0 9 16 1"; echo "CUDA1 9 16 1"; echo "Host 4 0 2"')
    devices = [gpu(0, 10000), gpu(1, 10000)]
    python = estimate(shape(), aggregate_context=8192, slots=4, cache_type="f16", flash_attn="auto", devices=devices)
    floored = run(FitParamsEstimator(binary, Path("m.gguf")), devices)
    raw = run(FitParamsEstimator(binary, Path("m.gguf"), compute_floor=False), devices)
    assert [d.compute_mib for d in raw.devices] == [1, 1]
    assert [d.compute_mib for d in floored.devices] == [d.compute_mib for d in python.devices]
    assert [d.index for d in floored.devices] == [0, 1] and floored.host == python.host


def test_a_failing_run_is_a_plan_error_of_one_line(tmp_path):
    binary = fake_fit_params(
        tmp_path,
        "echo \"llama_model_load: error loading model: unknown model architecture: 'x'\" >&2; "
        "echo \"terminate called after throwing an instance of 'std::runtime_error'\" >&2; exit 134",
    )
    with pytest.raises(PlanError) as info:
        run(FitParamsEstimator(binary, Path("m.gguf")), [cpu(10000)])
    assert info.value.message == (
        "llama-fit-params could not plan m.gguf (exit code 134): llama_model_load: error loading model: unknown model "
        "architecture: 'x'"
    )


def test_a_slow_run_times_out(tmp_path):
    binary = fake_fit_params(tmp_path, "exec sleep 5")
    with pytest.raises(PlanError, match="did not finish within 0.2 s"):
        run(FitParamsEstimator(binary, Path("m.gguf"), timeout_s=0.2), [cpu(10000)])


def test_a_missing_program_is_a_plan_error(tmp_path):
    with pytest.raises(PlanError, match="cannot be run from"):
        run(FitParamsEstimator(tmp_path / "nope", Path("m.gguf")), [cpu(10000)])


def test_rows_that_do_not_match_the_devices_are_refused(tmp_path):
    binary = fake_fit_params(tmp_path, 'echo "CUDA0 9 16 1"; echo "Host 4 0 2"')
    with pytest.raises(PlanError, match="the row count must equal the device count"):
        run(FitParamsEstimator(binary, Path("m.gguf")), [gpu(0, 10000), gpu(1, 10000)])


def test_the_python_estimator_plans_what_it_models_and_llama_fit_params_the_rest(tmp_path: Path) -> None:
    model, binary = tmp_path / "m.gguf", tmp_path / "llama-fit-params"
    asked: list[str] = []

    def find() -> Path:
        asked.append("asked")
        return binary

    modelled = choose_estimator(shape(), model, fit_params=find, embeddings=True)
    assert modelled == PythonEstimator(embeddings=True) and asked == []  # no install is looked up for it
    other = replace(shape(), architecture="someday-arch")
    assert choose_estimator(other, model, fit_params=find) == FitParamsEstimator(binary, model) and asked
    for missing in (None, lambda: None):
        with pytest.raises(PlanError, match=r"'someday-arch' is not modelled .* \(qiip engine install llama.cpp\)"):
            choose_estimator(other, model, fit_params=missing)
