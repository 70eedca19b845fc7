"""What the model catalog and the transfers cost: a cache scan, a hub download and an acquisition, each printed as a
ratio of a baseline measured in the same run.

1. Scan: a Hugging Face cache of `--repos` repositories and `--files` files in all (one GGUF per repository, the
   rest small config and tokenizer files), built with the test suite's cache builder. `scan_catalog` (cold: every
   GGUF header read; warm: headers remembered) against huggingface_hub's bare `scan_cache_dir` on the same cache;
   time and peak Python memory (`tracemalloc`).
2. Download: a `--size-mib` file from the loopback fake hub through `download_files` (huggingface_hub's
   `hf_hub_download`: HEAD, redirect to the storage host, GET) against `curl` fetching the same URL to a file.
3. Acquisition: the same file over HTTPS (a `trustme` certificate) through `ObjectStore.acquire` (the object's
   lock, 16 MiB durable chunks, SHA-256 of the bytes as read back from the disk, atomic publish) against
   `curl --cacert` to a file.

The servers run in a child process, as they would on another host: in a thread of the measuring process they
would share its interpreter lock with the client being measured (curl, a process of its own, never pays that).

    uv run python bench/models.py
    uv run python bench/models.py --repos 200 --files 5000 --size-mib 256 --repeat 3

Figures are the best of `--repeat` runs; they move with the machine, the ratios much less.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import multiprocessing
import os
import resource
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # never huggingface.co: the fake hub's URL is passed explicitly

from qiip_core.catalog import Download, ManifestFile, ObjectStore, Transfer, download_files, scan_catalog  # noqa: E402
from qiip_core.config import ModelSettings  # noqa: E402
from qiip_core.engines.llamacpp import make_test_gguf  # noqa: E402
from tests.support.fake_hub import FakeHub, FileServer  # noqa: E402
from tests.support.hf_cache import HfCacheBuilder  # noqa: E402


def best(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_s(fn: Callable[[], Any]) -> float:
    """CPU seconds (user and system) that one run of `fn` costs, in this process and the children it waited for:
    what a transfer costs whatever else the machine runs (wall-clock ratios move with the machine's load)."""
    before, children = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    waited = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    return time.process_time() - before + waited


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak Python memory allocated while `fn` runs, in MiB."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def build_cache(root: Path, work: Path, *, repos: int, files: int) -> None:
    gguf = make_test_gguf(work / "tiny.gguf")[0]
    cache = HfCacheBuilder(root)
    per_repo = max(files // repos, 1)
    for r in range(repos):
        repo, commit = f"bench/model-{r:03d}-GGUF", hashlib.sha1(str(r).encode()).hexdigest()
        cache.add_file(repo, commit, f"model-{r}-Q4_K_M.gguf", source=gguf)
        for f in range(per_repo - 1):
            cache.add_file(
                repo, commit, f"extra/file-{f:03d}.json", data=f'{{"repo": {r}, "file": {f}}}'.encode(), lfs=False
            )
        cache.set_ref(repo, "main", commit)


def scan_bench(work: Path, *, repos: int, files: int, repeat: int) -> None:
    from huggingface_hub import scan_cache_dir

    from qiip_core.catalog import _scan

    root = work / "hub"
    build_cache(root, work, repos=repos, files=files)

    def cold() -> None:
        _scan._summaries.clear()
        scan_catalog(root)

    catalog = scan_catalog(root)
    assert len(catalog.gguf) == repos and catalog.files == files, (len(catalog.gguf), catalog.files)
    base = best(lambda: scan_cache_dir(root), repeat)
    cold_s, warm_s = best(cold, repeat), best(lambda: scan_catalog(root), repeat)
    base_mib, cold_mib = peak_mib(lambda: scan_cache_dir(root)), peak_mib(cold)
    print(f"scan of {repos} repos, {files} files ({len(catalog.gguf)} GGUF generations)")
    print(f"  scan_cache_dir      {base * 1000:8.1f} ms  peak {base_mib:6.1f} MiB   (baseline)")
    print(f"  scan_catalog cold   {cold_s * 1000:8.1f} ms  peak {cold_mib:6.1f} MiB   x{cold_s / base:.2f} time")
    print(f"  scan_catalog warm   {warm_s * 1000:8.1f} ms                    x{warm_s / base:.2f} time")


def _serve(make: Callable[[], Any], conn: Any) -> None:
    server = make()
    with server.running():
        conn.send(getattr(server, "url", "") or f"{server.endpoint} {server.storage}")
        conn.recv()  # until the parent says stop


@contextlib.contextmanager
def in_child(make: Callable[[], Any]) -> Iterator[str]:
    """Run a test server (`FakeHub`, `FileServer`) in a child process, and yield its URL(s).

    In a thread of this process it would share the interpreter lock with the client being measured, which curl,
    another process, never does: the comparison would charge the server's Python to ours.
    """
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_serve, args=(make, child), daemon=True)
    process.start()
    try:
        yield str(parent.recv())
    finally:
        parent.send("stop")
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def curl(url: str, target: Path, *extra: str) -> None:
    subprocess.run(["curl", "-sSfL", "--noproxy", "*", "-o", str(target), *extra, url], check=True)


def transfer_bench(work: Path, *, size_mib: int, repeat: int) -> None:
    import trustme
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = False
    blob = work / "model.gguf"
    with blob.open("wb") as handle:
        for _ in range(size_mib):
            handle.write(os.urandom(2**20))
    size = blob.stat().st_size
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    mib = size / 2**20

    hub = FakeHub()
    hub.add("bench/download-GGUF", "d" * 40, {"model.gguf": blob})
    with in_child(lambda: hub) as urls:
        endpoint, storage = urls.split()

        def ours() -> None:
            cache = work / "dl-cache"
            shutil.rmtree(cache, ignore_errors=True)
            download = Download(id="dl_bench", repo_id="bench/download-GGUF", revision="main", files=("model.gguf",))
            download_files(download, settings=ModelSettings(hub_endpoint=endpoint), cache_dir=cache)

        url = f"{storage}/blobs/{digest}"
        base = best(lambda: curl(url, work / "curl.out"), repeat)
        mine = best(ours, repeat)
    print(f"hub download of {mib:.0f} MiB over loopback HTTP")
    print(f"  curl                {mib / base:8.1f} MiB/s   (baseline)")
    print(f"  download_files      {mib / mine:8.1f} MiB/s   x{base / mine:.2f} of curl's throughput")

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    bundle = work / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    server = FileServer(context)
    server.files["/model.gguf"] = blob
    with in_child(lambda: server) as server_url:
        file = ManifestFile(name="model.gguf", digest=f"sha256:{digest}", bytes=size, url=server_url + "/model.gguf")

        def acquire() -> None:
            store_dir = work / "store"
            shutil.rmtree(store_dir, ignore_errors=True)
            store = ObjectStore(store_dir)
            store.acquire(
                file,
                allowed_hosts=["127.0.0.1"],
                transfer=Transfer(),
                verify=ssl.create_default_context(cafile=bundle),
            )

        fetch = lambda: curl(file.url or "", work / "curl.out", "--cacert", str(bundle))  # noqa: E731
        base = best(fetch, repeat)
        mine = best(acquire, repeat)
        base_cpu, mine_cpu = min(cpu_s(fetch) for _ in range(repeat)), min(cpu_s(acquire) for _ in range(repeat))
    gib = mib / 1024
    print(f"acquisition of {mib:.0f} MiB over loopback HTTPS (16 MiB durable chunks, SHA-256 of the bytes on disk)")
    print(f"  curl --cacert       {mib / base:8.1f} MiB/s   {base_cpu / gib:5.2f} CPU s/GiB   (baseline)")
    print(
        f"  ObjectStore.acquire {mib / mine:8.1f} MiB/s   {mine_cpu / gib:5.2f} CPU s/GiB   "
        f"x{base / mine:.2f} of curl's throughput, x{mine_cpu / base_cpu:.2f} its CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repos", type=int, default=200)
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qiip-bench-models-") as tmp:
        work = Path(tmp)
        scan_bench(work, repos=args.repos, files=args.files, repeat=args.repeat)
        transfer_bench(work, size_mib=args.size_mib, repeat=args.repeat)


if __name__ == "__main__":
    main()
