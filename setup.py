"""Builds the native module ecx._core by driving the project's CMake build, so
`pip install --no-build-isolation .` works offline with Debian's setuptools.

The wheel carries libecx.so next to ecx/_core.so (the module finds it through its
$ORIGIN run path). Set ECX_CMAKE_ARGS for extra CMake options (e.g. -DECX_CUDA=OFF)
and ECX_BUILD_JOBS for the build's parallelism.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(ecx VERSION ([0-9.]+)", text)
    if not match:
        raise RuntimeError("cannot find the project version in CMakeLists.txt")
    return match.group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        destination = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DECX_BUILD_TESTS=OFF",
            "-DECX_BUILD_BENCH=OFF",
            "-DECX_BUILD_PYTHON=ON",
            f"-DPython3_EXECUTABLE={sys.executable}",
            # The module must find libecx beside itself once installed, not in this build tree.
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
            *shlex.split(os.environ.get("ECX_CMAKE_ARGS", "")),
        ]
        jobs = os.environ.get("ECX_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "ecx_core_module", "-j", jobs])
        built = next((build_dir / "python" / "ecx").glob("_core*.so"))
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, destination)
        for library in (build_dir / "lib").glob("libecx.so*"):
            if library.is_symlink():
                continue
            # The loader asks for the SONAME (libecx.so.0); ship the real file under it.
            soname = re.sub(r"(libecx\.so\.\d+).*", r"\1", library.name)
            shutil.copy2(library, destination.parent / soname)


setup(
    version=project_version(),
    ext_modules=[CMakeExtension("ecx._core")],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": "build-pip"}},
    zip_safe=False,
)
