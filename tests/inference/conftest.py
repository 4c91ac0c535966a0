"""The engine unit tests compare the engine against CPU references (teacher-forced log-probs of the same ``nn.Module``,
``generate`` on CPU), so on a machine with a GPU an engine left at ``device="auto"`` would move the shared model to
CUDA under the reference's feet. In this package ``"auto"`` therefore means CPU (module-scoped engine fixtures
included); the GPU tests (``-m gpu``) ask for ``device="cuda"`` explicitly."""

import pytest
import torch

from rlcore.inference import engine as engine_lib


@pytest.fixture(scope="package", autouse=True)
def _auto_engine_device_is_cpu():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_lib, "auto_device", lambda: torch.device("cpu"))
        yield
