"""The C++ layer kernels (csrc/layer_ops.cpp) against Hugging Face's formulas written out here."""
import pytest
import torch
import torch.nn.functional as F

from transformers.activations import ACT2FN

from pagedllm.model import ops
from pagedllm.model.config import ACTIVATIONS
from pagedllm.model.rope import RotaryEmbedding

pytestmark = pytest.mark.kernels
# float32: the same arithmetic up to summation order; bfloat16: one rounding of the output apart.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=["kernel", "pytorch"])
def path(request):
    """Every test runs twice: on the C++ kernels and on the PyTorch formulas that stand in for them."""
    return request.param


def chosen(path: str, kernel_path, torch_path):
    """The op a layer of this path gets; the kernel path must really be the kernel."""
    if path == "pytorch":
        return torch_path
    assert kernel_path is not torch_path, "the C++ kernels are not built"
    return kernel_path


def hf_rms_norm(x, weight, eps):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_residual_add(dtype, rows, path):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=generator).to(dtype)
    rms_norm = chosen(path, ops.rms_norm_op(CPU, 576), ops.rms_norm_torch)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    stream = residual.clone()
    normed = rms_norm(x, weight, 1e-5, residual=stream)
    torch.testing.assert_close(stream, residual + x, atol=0, rtol=0)   # the add rounds as torch's add
    torch.testing.assert_close(normed, hf_rms_norm(residual + x, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, path):
    gate_up = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    silu_and_mul = chosen(path, ops.gated_activation("silu", CPU, 1536), ops.silu_and_mul)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_every_gated_activation_as_transformers_computes_it(name):
    """act(gate) * up for each hidden_activation a config may name, against transformers' ACT2FN (Gemma's
    gelu_pytorch_tanh included)."""
    gate_up = torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 8
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.GATED_ACTIVATIONS[name](gate_up), ACT2FN[name](gate) * up,
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotation_matches_rotate_half(dtype, head_dim, path):
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, CPU)
    rope.kernel = chosen(path, rope.kernel, None)
    positions = torch.tensor([0, 1, 17, 4095, 300])
    qkv = torch.randn(5, 12 * head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, :9 * head_dim].view(5, 9, head_dim)   # a strided view, as the layer passes it
    expected = q.float().clone()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = (torch.cat((f, f), dim=-1)[:, None] for f in (angles.cos(), angles.sin()))
    rotated_half = torch.cat((-expected[..., head_dim // 2:], expected[..., :head_dim // 2]), dim=-1)
    expected = expected * cos + rotated_half * sin
    result = rope.at(positions).apply(q)
    if path == "kernel":
        assert result.data_ptr() == q.data_ptr()   # in place, inside qkv
    torch.testing.assert_close(result.float(), expected, **TOLERANCE[dtype])
