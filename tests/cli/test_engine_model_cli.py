from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from qiip_core.engines.llamacpp import read_gguf_metadata

FAKE_CMAKE = """\
cmake_minimum_required(VERSION 3.14)
project(fakellama C)
add_executable(llama-server main.c)
set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""

FAKE_MAIN = '#include <stdio.h>\nint main(void) { puts("version: 0.0.1-fake"); return 0; }\n'


def make_archive(path: Path, files: dict[str, str], top: str = "llama.cpp-b1") -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def runner(tmp_path, monkeypatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)  # no stray .env
    for name in ("QIIP_CONFIG", "QIIP_ENGINES__LLAMACPP__SERVER_BINARY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__INSTALL_DIR", str(tmp_path / "engines"))
    monkeypatch.setenv("QIIP_STATE_DIR", str(tmp_path / "state"))
    return CliRunner()


def test_make_test_gguf_prints_the_written_path(runner, tmp_path):
    target = tmp_path / "models" / "t.gguf"
    result = runner.invoke(
        cli,
        ["model", "make-test-gguf", str(target), "--layers", "3", "--embd", "128", "--heads", "4", "--kv-heads", "2"],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [str(target)]
    meta = read_gguf_metadata(target)
    assert (meta.n_layers, meta.n_embd, meta.n_head, meta.n_head_kv) == (3, 128, 4, 2)


def test_make_test_gguf_split_prints_every_shard(runner, tmp_path):
    result = runner.invoke(cli, ["model", "make-test-gguf", str(tmp_path / "s.gguf"), "--split", "2", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        str(tmp_path / "s-00001-of-00002.gguf"),
        str(tmp_path / "s-00002-of-00002.gguf"),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--heads", "3"], "error: --heads must be at least 1 and divide --embd (64), got 3."),
        (["--heads", "8", "--kv-heads", "3"], "error: --kv-heads must be at least 1 and divide --heads (8), got 3."),
        (["--vocab", "10"], "error: --vocab must be between 300"),
        (["--split", "99"], "error: --split must be between 1 and the number of tensors (21 for 2 layers)"),
    ],
)
def test_make_test_gguf_bad_input_is_one_error_line(runner, tmp_path, args, message):
    result = runner.invoke(cli, ["model", "make-test-gguf", str(tmp_path / "x.gguf"), *args])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(message)
    assert not list(tmp_path.glob("*.gguf"))


def test_status_when_nothing_is_installed(runner, tmp_path):
    result = runner.invoke(cli, ["engine", "status"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"llama.cpp: not installed in {tmp_path / 'engines'}"


def test_status_with_a_configured_binary(runner, tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SERVER_BINARY", str(binary))
    result = runner.invoke(cli, ["engine", "status"])
    assert result.exit_code == 0, result.output
    assert "llama.cpp: installed (engines.llamacpp.server_binary)" in result.stdout
    assert f"server:     {binary}" in result.stdout


def test_status_with_a_missing_configured_binary_is_an_error(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SERVER_BINARY", str(tmp_path / "nope"))
    result = runner.invoke(cli, ["engine", "status"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: engines.llamacpp.server_binary")


def test_install_custom_version_without_digest(runner, monkeypatch):
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__VERSION", "0.3.99")
    result = runner.invoke(cli, ["engine", "install", "llama.cpp", "--cpu"])
    assert result.exit_code == 1
    assert "QIIP_ENGINES__LLAMACPP__SHA256" in result.stderr
    assert result.stderr.startswith("error: ")


def test_install_archive_with_wrong_digest(runner, tmp_path, monkeypatch):
    archive = tmp_path / "src.tar.gz"
    make_archive(archive, {"CMakeLists.txt": FAKE_CMAKE, "main.c": FAKE_MAIN})
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SOURCE_KIND", "llama.cpp")
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__VERSION", "b1")
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SHA256", "f" * 64)
    result = runner.invoke(cli, ["engine", "install", "llama.cpp", "--cpu", "--archive", str(archive)])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[-2] == "verifying sha256"
    assert lines[-1].startswith("error: The archive from ") and "f" * 64 in lines[-1]
    assert result.stdout == ""


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is needed")
def test_install_from_archive_then_status(runner, tmp_path, monkeypatch):
    archive = tmp_path / "src.tar.gz"
    digest = make_archive(archive, {"CMakeLists.txt": FAKE_CMAKE, "main.c": FAKE_MAIN})
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SOURCE_KIND", "llama.cpp")
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__VERSION", "b1")
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SHA256", digest)
    result = runner.invoke(cli, ["engine", "install", "llama.cpp", "--cpu", "--archive", str(archive)])
    assert result.exit_code == 0, result.output
    server = tmp_path / "engines" / "b1-cpu" / "bin" / "llama-server"
    assert result.stdout.splitlines() == [f"llama-server: {server}"]
    progress = result.stderr.splitlines()
    assert progress[1:4] == ["verifying sha256", "extracting", "configuring"]
    assert "building 100% (llama-server)" in progress and progress[-1] == "publishing"

    again = runner.invoke(cli, ["engine", "install", "llama.cpp", "--cpu", "--archive", str(archive)])
    assert again.exit_code == 0
    assert again.stderr.splitlines() == [f"already installed: {server.parent.parent}"]

    status = runner.invoke(cli, ["engine", "status"])
    assert status.exit_code == 0
    assert "llama.cpp: installed" in status.stdout
    assert "version:    b1" in status.stdout and "variant:    cpu" in status.stdout
    assert f"server:     {server}" in status.stdout


def test_the_arch_help_names_every_architecture() -> None:
    from click.testing import CliRunner

    from qiip_cli._main import cli
    from qiip_core.engines.llamacpp import TEST_ARCHITECTURES

    text = " ".join(CliRunner().invoke(cli, ["model", "make-test-gguf", "--help"]).output.split())
    assert all(name in text for name in TEST_ARCHITECTURES)
