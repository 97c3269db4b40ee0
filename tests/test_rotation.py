"""kvcompile.rotation: the Hadamard matrix is orthonormal (exact on integers, float64 rounding
once normalized), block-diagonal for head dims that are not powers of two, and refused where
it would rotate almost nothing."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompile import rotation

HEAD_DIMS = [8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 256]


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_orthonormal_in_float64(D):
    R = rotation.hadamard(D, torch.float64)
    I = torch.eye(D, dtype=torch.float64)
    # the ±1 blocks: A @ A.T == n I exactly, in integers
    i = 0
    for n in rotation.hadamard_blocks(D):
        A = torch.round(R[i : i + n, i : i + n] * math.sqrt(n)).to(torch.int64)
        assert set(A.unique().tolist()) == {-1, 1}
        assert torch.equal(A @ A.T, n * torch.eye(n, dtype=torch.int64))
        i += n
    assert i == D
    # normalized, float64: I up to one rounding of 1/sqrt(n) (exactly I for blocks of 4^k channels)
    err = (R @ R.T - I).abs().max().item()
    assert err <= 2.3e-16, err
    if all(math.log2(n) % 2 == 0 for n in rotation.hadamard_blocks(D)):
        assert torch.equal(R @ R.T, I)
    assert torch.equal(R, R.T)
    # float32, what the cache stores: orthonormal to float32 rounding
    R32 = rotation.hadamard(D)
    assert R32.dtype == torch.float32
    assert (R32.double() @ R32.double().T - I).abs().max() < 1e-7


@pytest.mark.parametrize("D,blocks", [(64, [64]), (80, [64, 16]), (96, [64, 32]), (112, [64, 32, 16]),
                                      (160, [128, 32]), (192, [128, 64]), (72, [64, 8])])
def test_block_diagonal_for_other_head_dims(D, blocks):
    assert rotation.hadamard_blocks(D) == blocks
    R = rotation.hadamard(D, torch.float64)
    i = 0
    for n in blocks:
        block = R[i : i + n, i : i + n]
        assert (block.abs() == 1 / math.sqrt(n)).all()  # every channel of a block mixes all of them
        assert (R[i : i + n, :i] == 0).all() and (R[i : i + n, i + n :] == 0).all()
        i += n


def test_rotation_spreads_an_outlier_channel():
    # the point of rotating: one large channel becomes a flat vector, so its amax falls by sqrt(n)
    x = torch.zeros(64)
    x[5] = 8.0
    y = x @ rotation.hadamard(64)
    assert torch.allclose(y.abs(), torch.full((64,), 1.0))
    assert torch.allclose(y @ rotation.hadamard(64).T, x, atol=1e-6)


@pytest.mark.parametrize("D", [0, 4, 12, 36, 100])
def test_head_dims_without_a_rotation_are_refused(D):
    with pytest.raises(ValueError, match=f"head_dim={D} has no Hadamard rotation.*rotate=False"):
        rotation.hadamard(D)


def test_returns_a_new_tensor():
    a = rotation.hadamard(16)
    a.zero_()
    assert rotation.hadamard(16).abs().sum() > 0  # the cached float64 matrix is not handed out
