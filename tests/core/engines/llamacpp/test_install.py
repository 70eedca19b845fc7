from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from qiip_core import ConfigError, DigestMismatch, EngineBuildError, EngineError
from qiip_core.config import LlamaCppEngineSettings
from qiip_core.engines.llamacpp import InstalledEngine, LlamaCppInstaller
from qiip_core.engines.llamacpp._build import CMAKE_FLAGS, CMakeBuild, _percent, nvidia_gpu_count
from qiip_core.engines.llamacpp._source import (
    DEFAULT_LLAMACPP_URL_TEMPLATE,
    PINNED_SHA256,
    extract_archive,
    find_sdist_url,
    resolve_source,
)

PINNED = PINNED_SHA256[("pypi-sdist", "0.3.36")]

FAKE_CMAKE = """\
cmake_minimum_required(VERSION 3.14)
project(fakellama C)
add_executable(llama-server main.c)
add_executable(llama-quantize main.c)
set_target_properties(llama-server llama-quantize PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""

FAKE_MAIN = '#include <stdio.h>\nint main(void) { puts("version: 9.9.9-fake (build 1, commit 0000000)"); return 0; }\n'

FAILING_CMAKE = """\
cmake_minimum_required(VERSION 3.14)
project(broken C)
message(FATAL_ERROR "this source tree refuses to configure")
"""

needs_cmake = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("cc") is None, reason="cmake and a C compiler are needed"
)


def make_archive(path: Path, files: dict[str, str], *, top: str = "llama.cpp-b1") -> str:
    """Write a .tar.gz with `files` under `top/`; return its SHA-256."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def settings_for(install_dir: Path, **values: object) -> LlamaCppEngineSettings:
    return LlamaCppEngineSettings(install_dir=install_dir, **values)


def llamacpp_settings(install_dir: Path, version: str, sha256: str) -> LlamaCppEngineSettings:
    return settings_for(install_dir, source_kind="llama.cpp", version=version, sha256=sha256)


# --- source resolution ---------------------------------------------------------------------------------


def test_default_version_uses_the_pinned_digest_and_the_index(tmp_path):
    spec = resolve_source(settings_for(tmp_path))
    assert (spec.kind, spec.version, spec.sha256, spec.url) == ("pypi-sdist", "0.3.36", PINNED, None)


def test_custom_version_without_digest_is_refused_naming_the_setting(tmp_path):
    installer = LlamaCppInstaller(settings_for(tmp_path, version="0.3.99"))
    with pytest.raises(ConfigError, match=r"engines\.llamacpp\.sha256 \(QIIP_ENGINES__LLAMACPP__SHA256\)"):
        installer.install(cpu=True)
    assert list(tmp_path.iterdir()) == []


def test_llamacpp_release_needs_a_digest_and_uses_the_github_tag_archive(tmp_path):
    with pytest.raises(ConfigError, match="sha256"):
        resolve_source(settings_for(tmp_path, source_kind="llama.cpp", version="b6500"))
    spec = resolve_source(llamacpp_settings(tmp_path, "b6500", "a" * 64))
    assert spec.url == DEFAULT_LLAMACPP_URL_TEMPLATE.format(version="b6500")
    assert spec.url == "https://github.com/ggml-org/llama.cpp/archive/refs/tags/b6500.tar.gz"


def test_url_template_overrides_the_index(tmp_path):
    spec = resolve_source(settings_for(tmp_path, url_template="https://mirror.example/src/{version}.tgz"))
    assert spec.url == "https://mirror.example/src/0.3.36.tgz"
    with pytest.raises(ConfigError, match="url_template"):
        resolve_source(settings_for(tmp_path, url_template="https://mirror.example/{release}.tgz"))


@pytest.mark.parametrize("version", ["../evil", "a b", "", "x/y"])
def test_unsafe_versions_are_refused(tmp_path, version):
    with pytest.raises(ConfigError, match=r"engines\.llamacpp\.version"):
        resolve_source(settings_for(tmp_path, version=version, sha256="b" * 64))


def _index(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_sdist_url_from_a_pep691_json_index():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url == "https://idx.example/simple/llama-cpp-python/"
        assert "application/vnd.pypi.simple.v1+json" in request.headers["accept"]
        files = [
            {"filename": "llama_cpp_python-0.3.35.tar.gz", "url": "https://files.example/a/035.tar.gz"},
            {"filename": "llama_cpp_python-0.3.36.tar.gz", "url": "https://files.example/b/036.tar.gz"},
        ]
        return httpx.Response(
            200, json={"files": files}, headers={"content-type": "application/vnd.pypi.simple.v1+json"}
        )

    with _index(handler) as client:
        assert find_sdist_url(client, "https://idx.example/simple", "0.3.36") == "https://files.example/b/036.tar.gz"


def test_sdist_url_from_a_pep503_html_index_with_relative_links():
    page = (
        "<html><body>"
        '<a href="../../packages/x/llama_cpp_python-0.3.36-py3-none-any.whl#sha256=00">wheel</a>'
        '<a href="../../packages/y/llama_cpp_python-0.3.36.tar.gz#sha256=11">llama_cpp_python-0.3.36.tar.gz</a>'
        "</body></html>"
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=page, headers={"content-type": "text/html"})

    with _index(handler) as client:
        url = find_sdist_url(client, "https://idx.example/simple/llama-cpp-python/", "0.3.36")
    assert url == "https://idx.example/packages/y/llama_cpp_python-0.3.36.tar.gz"


def test_index_without_the_version_is_an_engine_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"files": []}, headers={"content-type": "application/vnd.pypi.simple.v1+json"})

    with _index(handler) as client, pytest.raises(EngineError, match="lists no source distribution"):
        find_sdist_url(client, "https://idx.example/simple", "0.3.36")


# --- digest verification -------------------------------------------------------------------------------


def test_local_archive_with_the_wrong_digest_is_refused_before_extraction(tmp_path):
    archive = tmp_path / "src.tar.gz"
    make_archive(archive, {"CMakeLists.txt": FAKE_CMAKE})
    install_dir = tmp_path / "engines"
    installer = LlamaCppInstaller(llamacpp_settings(install_dir, "b1", "0" * 64))
    with pytest.raises(DigestMismatch) as caught:
        installer.install(cpu=True, archive=archive)
    assert caught.value.expected == "0" * 64
    assert caught.value.actual == hashlib.sha256(archive.read_bytes()).hexdigest()
    leftovers = sorted(p.name for p in install_dir.iterdir())
    assert leftovers == [".lock", "build-b1-cpu.log"]  # no version dir, no staging, no current
    assert installer.find_installed() is None


def test_downloaded_archive_with_the_wrong_digest_is_removed(tmp_path):
    payload = b"definitely not the pinned sdist"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/simple/llama-cpp-python/":
            files = [{"filename": "llama_cpp_python-0.3.36.tar.gz", "url": "https://files.example/s.tar.gz"}]
            return httpx.Response(
                200, json={"files": files}, headers={"content-type": "application/vnd.pypi.simple.v1+json"}
            )
        assert str(request.url) == "https://files.example/s.tar.gz"
        return httpx.Response(200, content=payload)

    lines: list[str] = []
    installer = LlamaCppInstaller(
        settings_for(tmp_path, index_url="https://idx.example/simple"), transport=httpx.MockTransport(handler)
    )
    with pytest.raises(DigestMismatch, match=PINNED):
        installer.install(cpu=True, progress=lines.append)
    assert lines[0].startswith("downloading 0.0 MiB from https://files.example/s.tar.gz")
    assert "verifying sha256" in lines
    assert "extracting" not in lines
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_unsafe_archive_members_are_refused(tmp_path):
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(EngineBuildError, match="cannot be extracted"):
        extract_archive(archive, tmp_path / "x")
    assert not (tmp_path / "outside.txt").exists()


# --- variant choice --------------------------------------------------------------------------------------


@pytest.mark.skipif(nvidia_gpu_count()[0] > 0, reason="this host has an NVIDIA GPU")
def test_without_a_gpu_a_cuda_build_is_refused_and_points_to_cpu(tmp_path):
    installer = LlamaCppInstaller(settings_for(tmp_path))
    with pytest.raises(EngineError, match=r"No NVIDIA GPU was found .*--cpu"):
        installer.install(cpu=False)
    assert list(tmp_path.iterdir()) == []


# --- finding what is installed ------------------------------------------------------------------------------


def test_nothing_installed(tmp_path):
    assert LlamaCppInstaller(settings_for(tmp_path / "none")).find_installed() is None


def test_server_binary_setting_wins_and_must_be_executable(tmp_path):
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    with pytest.raises(ConfigError, match="QIIP_ENGINES__LLAMACPP__SERVER_BINARY"):
        LlamaCppInstaller(settings_for(tmp_path, server_binary=binary)).find_installed()
    binary.chmod(0o755)
    found = LlamaCppInstaller(settings_for(tmp_path, server_binary=binary)).find_installed()
    assert found == InstalledEngine(
        root=binary.parent, server=binary, fit_params=None, quantize=None, version="unknown", variant="unknown"
    )


def test_server_binary_from_the_environment(tmp_path, monkeypatch):
    from qiip_core.config import load_settings

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("QIIP_ENGINES__LLAMACPP__SERVER_BINARY", str(binary))
    found = LlamaCppInstaller(load_settings().engines.llamacpp).find_installed()
    assert found is not None and found.server == binary


def test_progress_percentages_from_makefiles_and_ninja():
    assert _percent("[ 45%] Building CXX object src/llama.cpp.o\n") == 45
    assert _percent("[100%] Built target llama-server\n") == 100
    assert _percent("[12/48] Building C object ggml.c.o\n") == 25
    assert _percent("-- Configuring done\n") is None


def test_configure_command_spells_out_every_option(tmp_path, monkeypatch):
    build = CMakeBuild(
        tmp_path / "src",
        tmp_path / "build",
        variant="cuda",
        log_path=tmp_path / "log",
        ccache_basedir=tmp_path,
        progress=lambda line: None,
    )
    args = build.configure_args()
    for flag in CMAKE_FLAGS:
        assert flag in args
    assert "-DGGML_CUDA=ON" in args
    assert "-DBUILD_SHARED_LIBS=OFF" in args and "-DGGML_NATIVE=OFF" in args
    assert not any(a.startswith("-DCMAKE_CUDA_ARCHITECTURES") for a in args)  # llama.cpp's portable list
    build.cuda_architectures = "90"
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in build.configure_args()


# --- real CMake builds of tiny source trees ------------------------------------------------------------------


@pytest.fixture
def fake_source(tmp_path) -> tuple[Path, str]:
    archive = tmp_path / "fake-b1.tar.gz"
    digest = make_archive(archive, {"CMakeLists.txt": FAKE_CMAKE, "main.c": FAKE_MAIN})
    return archive, digest


@needs_cmake
@pytest.mark.integration
def test_build_publish_reuse_and_force(tmp_path, fake_source):
    archive, digest = fake_source
    install_dir = tmp_path / "engines"
    installer = LlamaCppInstaller(llamacpp_settings(install_dir, "b1", digest))
    lines: list[str] = []
    installed = installer.install(cpu=True, archive=archive, progress=lines.append)

    root = install_dir / "b1-cpu"
    assert installed.root == root
    assert installed.server == root / "bin" / "llama-server"
    assert installed.quantize == root / "bin" / "llama-quantize"
    assert installed.fit_params is None  # the fake source has no such target
    assert (installed.version, installed.variant, installed.source_kind) == ("b1", "cpu", "llama.cpp")
    assert os.readlink(install_dir / "current") == "b1-cpu"
    assert installer.find_installed() == installed
    info = json.loads((root / "build.json").read_text())
    assert info["targets"] == ["llama-server", "llama-quantize"]
    assert info["sha256"] == digest
    assert info["engine_version"] == "version: 9.9.9-fake (build 1, commit 0000000)"
    assert info["built_at"].endswith("Z")
    assert [line for line in lines if not line.startswith("building")] == [
        lines[0],
        "verifying sha256",
        "extracting",
        "configuring",
        "publishing",
    ]
    assert "building 100% (llama-server)" in lines
    assert sorted(p.name for p in install_dir.iterdir()) == [".lock", "b1-cpu", "build-b1-cpu.log", "current"]

    again: list[str] = []
    assert installer.install(cpu=True, archive=archive, progress=again.append) == installed
    assert again == [f"already installed: {root}"]

    marker = root / "bin" / "marker"
    marker.write_text("old build")
    forced = installer.install(cpu=True, archive=archive, force=True)
    assert forced.root == root and not marker.exists()
    assert os.readlink(install_dir / "current") == "b1-cpu"


@needs_cmake
@pytest.mark.integration
def test_failing_build_keeps_the_previous_install_current(tmp_path, fake_source):
    archive, digest = fake_source
    install_dir = tmp_path / "engines"
    previous = LlamaCppInstaller(llamacpp_settings(install_dir, "b1", digest)).install(cpu=True, archive=archive)

    broken = tmp_path / "broken-b2.tar.gz"
    broken_digest = make_archive(broken, {"CMakeLists.txt": FAILING_CMAKE}, top="llama.cpp-b2")
    installer = LlamaCppInstaller(llamacpp_settings(install_dir, "b2", broken_digest))
    with pytest.raises(EngineBuildError, match="configure step failed") as caught:
        installer.install(cpu=True, archive=broken)
    assert "this source tree refuses to configure" in caught.value.message
    assert os.readlink(install_dir / "current") == "b1-cpu"
    assert installer.find_installed() == previous
    names = sorted(p.name for p in install_dir.iterdir())
    assert names == [".lock", "b1-cpu", "build-b1-cpu.log", "build-b2-cpu.log", "current"]
    assert "refuses to configure" in (install_dir / "build-b2-cpu.log").read_text()


@needs_cmake
@pytest.mark.integration
def test_concurrent_installs_build_once(tmp_path, fake_source):
    archive, digest = fake_source
    install_dir = tmp_path / "engines"
    results: list[InstalledEngine] = []
    logs: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            installer = LlamaCppInstaller(llamacpp_settings(install_dir, "b1", digest))
            results.append(installer.install(cpu=True, archive=archive, progress=logs[index].append))
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results[0] == results[1]
    reused = [log for log in logs if any(line.startswith("already installed") for line in log)]
    built = [log for log in logs if "publishing" in log]
    assert len(reused) == 1 and len(built) == 1


@needs_cmake
@pytest.mark.integration
def test_leftovers_of_an_interrupted_install_are_removed(tmp_path, fake_source):
    archive, digest = fake_source
    install_dir = tmp_path / "engines"
    (install_dir / ".build-dead").mkdir(parents=True)
    (install_dir / "b0-cpu.tmp-dead" / "bin").mkdir(parents=True)
    LlamaCppInstaller(llamacpp_settings(install_dir, "b1", digest)).install(cpu=True, archive=archive)
    assert sorted(p.name for p in install_dir.iterdir()) == [".lock", "b1-cpu", "build-b1-cpu.log", "current"]
