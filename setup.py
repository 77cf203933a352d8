"""Builds the C++ CPU kernel extension (csrc/) with CMake + ninja.

One binary serves every x86-64 CPU: per-ISA kernels are compiled with their own target
attributes inside csrc/ and chosen at run time from CPUID, so no ``-march=native`` here.
Set ``KT_BUILD_TYPE=Debug`` or ``KT_SANITIZE=1`` (ASan + UBSan) for development builds.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_type = os.environ.get("KT_BUILD_TYPE", "Release")
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DKT_EXT_NAME={ext.name.rpartition('.')[2]}",
            f"-DKT_SANITIZE={'ON' if os.environ.get('KT_SANITIZE') else 'OFF'}",
            "-G",
            "Ninja",
        ]
        cmake_args += [a for a in os.environ.get("CMAKE_ARGS", "").split() if a]
        subprocess.run(["cmake", ext.source_dir, *cmake_args], cwd=build_dir, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)


setup(
    ext_modules=[CMakeExtension("ktransformers.cpuinfer_ext", ROOT / "csrc")],
    cmdclass={"build_ext": CMakeBuild},
)
