"""Test-session setup. Kept minimal: nothing heavy is imported here.

Without CUDA, Triton kernels can only run in its interpreter, and TRITON_INTERPRET is read
when triton is first imported, so it is set here, before any test module imports triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def dynamo_reset_around():
    """Dynamo's caches reset before and after a test (modules opt in with ``usefixtures``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
