"""mlxtoy's install, with its CPU kernels (kernels/: float32 MLX primitives in C++, the
`mlxtoy_kernels` package) built in where they apply: Linux x86-64 with CMake and a C++20
compiler. Elsewhere (macOS, which has Accelerate and Metal; ARM) they are not built, and where
their build fails mlxtoy installs without them: either way it runs its MLX-only path.

The kernels are compiled against the MLX that the build imports and record its version
(mlxtoy_kernels/mlx_version.txt); mlxtoy refuses a build for another MLX at import. With build
isolation that is the newest MLX the isolated environment got; `--no-build-isolation` (as
scripts/setup.sh does) builds against the MLX already installed.
"""

import platform
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

KERNELS_APPLY = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
KERNELS_STAMP = "mlx_version.txt"  # mlxtoy.backend.KERNELS_STAMP


def kernels_build() -> dict:
    """setup() arguments that build the kernels, or none where they do not apply or MLX is absent."""
    if not KERNELS_APPLY:
        return {}
    try:
        import mlx.core as mx
        from mlx.extension import CMakeBuild, CMakeExtension
    except ImportError as e:  # a build without isolation before MLX is installed
        print(f"mlxtoy: building without the CPU kernels: MLX is not importable here ({e})", file=sys.stderr)
        return {}

    class KernelsBuild(CMakeBuild):
        """CMake's build of kernels/, stamped with the MLX version; a failed build (no compiler,
        no CMake) leaves mlxtoy without the kernels instead of failing the install."""

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except (OSError, subprocess.CalledProcessError) as e:
                print(f"mlxtoy: the CPU kernels did not build ({e}); mlxtoy runs without them",
                      file=sys.stderr)
                return
            stamp = Path(self.get_ext_fullpath(ext.name)).parent / KERNELS_STAMP
            stamp.write_text(mx.__version__ + "\n", encoding="utf-8")

    return {
        "ext_modules": [CMakeExtension("mlxtoy_kernels._ext", sourcedir="kernels")],
        "cmdclass": {"build_ext": KernelsBuild},
    }


kernels = kernels_build()
setup(
    packages=find_packages(include=["mlxtoy*", "tui*"]) + (["mlxtoy_kernels"] if kernels else []),
    package_dir={"mlxtoy_kernels": "kernels/mlxtoy_kernels"} if kernels else {},
    # the stamp comes from this build (KernelsBuild), never from a source tree an editable build wrote it into
    exclude_package_data={"mlxtoy_kernels": [KERNELS_STAMP]},
    zip_safe=False,
    **kernels,
)
