from setuptools import setup

from mlx import extension

setup(
    ext_modules=[extension.CMakeExtension("mlxtoy_kernels._ext")],
    cmdclass={"build_ext": extension.CMakeBuild},
    packages=["mlxtoy_kernels"],
    zip_safe=False,
)
