"""pytest setup for the whole run. Kept minimal: nothing heavy is imported here.

Without CUDA, Triton kernels can only run in its interpreter, and TRITON_INTERPRET is read
when triton is first imported, so it is set here, before any test module imports triton.
The fixtures here are the ones several test modules use.
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


@pytest.fixture
def fp8_safe_schema_check(monkeypatch):
    """opcheck's test_schema compares inputs before/after with torch.allclose, which has no fp8
    kernel on CPU ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn). Compare fp8
    tensors bitwise instead, which is what that check means (was this input mutated?)."""
    real = torch.allclose

    def allclose(a, b, *args, **kwargs):
        if a.dtype == torch.float8_e4m3fn:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose)


@pytest.fixture
def fp16_dots():
    """The attention kernels' dots in fp16, as the GPU runs them for 16-bit queries, in the
    interpreter too (whose plans take fp32 dots: numpy has no bf16 dot); GPU plans are left alone."""
    from kvcompile.kernels import plan
    from kvcompile.kernels.common import interpreting

    if not interpreting():
        yield
        return
    with plan.override(dot_dtype=torch.float16):
        yield
