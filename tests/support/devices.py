"""The devices a test can run on: the CPU always, CUDA when this machine has it (marked `gpu`)."""

import pytest
import torch

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]
