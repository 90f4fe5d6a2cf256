"""Builds the native planning helpers (rannc._C) from csrc/ with pybind11."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "rannc._C",
        sorted(["csrc/bindings.cpp", "csrc/graph_algos.cpp", "csrc/coarsen.cpp", "csrc/stage_dp.cpp"]),
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
