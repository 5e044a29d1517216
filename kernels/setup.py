import os

from setuptools import setup
from setuptools.command.build_py import build_py

import mlx.core as mx
from mlx import extension

STAMP = "mlx_version.txt"  # mlxtoy.backend.KERNELS_STAMP: read before the extension is imported


class BuildPyWithStamp(build_py):
    """Records the MLX version the extension is compiled against: mlxtoy refuses a build for
    another MLX (its primitives would meet another MLX's arrays) and runs without it."""

    def run(self):
        super().run()
        package = os.path.join(self.build_lib, "mlxtoy_kernels")
        os.makedirs(package, exist_ok=True)
        with open(os.path.join(package, STAMP), "w", encoding="utf-8") as f:
            f.write(mx.__version__ + "\n")


setup(
    ext_modules=[extension.CMakeExtension("mlxtoy_kernels._ext")],
    cmdclass={"build_ext": extension.CMakeBuild, "build_py": BuildPyWithStamp},
    packages=["mlxtoy_kernels"],
    zip_safe=False,
)
