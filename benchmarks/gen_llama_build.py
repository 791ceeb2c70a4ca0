"""llama.cpp's ``llama-server`` and ``llama-quantize``, built once from llama-cpp-python's sdist.

None of llama.cpp is committed: the sdist from the package registry carries it in
``vendor/llama.cpp``, with its GGUF converter (which puts the sdist's ``gguf-py`` on its
path). The build (15 minutes on 2 quiet cores, 40 on a loaded machine) goes to
``<cache>/llama.cpp-<version>`` and is reused while its ``.ready`` marker exists;
``python -m benchmarks.gen_llama_build`` builds it ahead of a run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.gen_models import cache_root

TARGETS = ("llama-server", "llama-quantize")


def sdist() -> Path:
    """The newest llama-cpp-python sdist, downloaded into the cache once."""
    folder = cache_root() / "llama-cpp-python-sdist"
    found = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:"]
    subprocess.run([*command, "--no-deps", "llama-cpp-python", "-d", str(folder)], check=True)
    return sorted(folder.glob("llama_cpp_python-*.tar.gz"))[-1]


def version_of(archive: Path) -> str:
    return archive.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")


def build_root() -> Path:
    return cache_root() / f"llama.cpp-{version_of(sdist())}"


def source() -> Path:
    """The unpacked ``vendor/llama.cpp`` of the sdist."""
    root = build_root()
    tree = root / "src" / "vendor" / "llama.cpp"
    if (root / "src" / ".unpacked").exists():
        return tree
    shutil.rmtree(root / "src", ignore_errors=True)
    scratch = root / "src.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with tarfile.open(sdist()) as archive:
        archive.extractall(scratch, filter="data")
    (inner,) = scratch.iterdir()
    inner.rename(root / "src")
    scratch.rmdir()
    (root / "src" / ".unpacked").write_text("ok\n")
    return tree


def binaries() -> Path:
    """The folder holding ``llama-server`` and ``llama-quantize`` (built when missing)."""
    root = build_root()
    bin_dir = root / "build" / "bin"
    if (root / ".ready").exists():
        return bin_dir
    tree = source()
    print(f"  building llama.cpp in {root} (15-40 minutes on 2 cores; build.log)", flush=True)
    configure = ["cmake", "-S", str(tree), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release"]
    configure += ["-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
    configure += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    build = ["cmake", "--build", str(root / "build"), "-j2", "--target", *TARGETS]
    with (root / "build.log").open("w") as log:  # the compiler's warnings run to 10 000s of lines
        for step in (configure, build):
            subprocess.run(["nice", "-n", "10", *step], check=True, stdout=log, stderr=log)
    (root / ".ready").write_text("ok\n")
    return bin_dir


if __name__ == "__main__":
    print(binaries())
