"""Every Triton kernel of the package, run on CPU by Triton's interpreter (TRITON_INTERPRET=1: each program executed
with numpy), against the references its GPU test uses, at shapes small enough for the default suite.

Why: the kernels otherwise run only in the gpu-marked tests, on a GPU that is lent rarely; here a wrong index, mask,
stride, formula, residual term or batch dependence fails on every commit. What the interpreter cannot show stays with
the GPU tests: races, alignment, num_warps, the compiled code's own rounding and speed.

The interpreter is on only where tests/conftest.py switched it on before triton's import (no CUDA); elsewhere the
gpu-marked tests check the compiled kernels and this file is skipped.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

triton = pytest.importorskip("triton", reason="Triton's interpreter checks the kernels: pip install -e '.[test]'")
if tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7):
    pytest.skip("Triton 3.6's interpreter cannot run a loop bounded by a kernel argument under numpy 2.4 "
                "(int() of a 1-element array): pip install 'triton>=3.7'", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA is here: the gpu-marked tests check the compiled kernels", allow_module_level=True)

KERNEL_MODULES = (
    "shardrl.models.norm_kernel",
    "shardrl.models.rope_kernel",
    "shardrl.parallel.bitwise_kernels",
    "shardrl.parallel.grad_add_kernel",
    "shardrl.parallel.moe_rows_kernel",
    "shardrl.parallel.swiglu_kernel",
    "shardrl.parallel.vocab_kernels",
    "shardrl.rollout.decode_attention",
    "shardrl.rollout.sample_kernel",
    "shardrl.sync.checksum_kernel",
)


@pytest.fixture(scope="module")
def kernels() -> dict[str, ModuleType]:
    """{last part of the module name: the module}, its `@triton.jit` functions interpreted."""
    return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in KERNEL_MODULES}


@pytest.fixture(autouse=True)
def _quiet_numpy() -> Iterator[None]:
    """Masked-off lanes compute inf * 0 and the like before `tl.where` drops them; numpy warns about each."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_every_kernel_module_is_checked_here():
    """A new `@triton.jit` module must join KERNEL_MODULES (and get a test below)."""
    package = pathlib.Path(__file__).resolve().parents[1] / "shardrl"
    found = {".".join(path.relative_to(package.parent).with_suffix("").parts)
             for path in package.rglob("*.py") if re.search(r"^@triton\.jit", path.read_text(), re.MULTILINE)}
    assert found == set(KERNEL_MODULES)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# --- RMSNorm (models/norm_kernel.py): bitwise mode's forward, every training pass's backward --------------------

@pytest.mark.parametrize("rows,width", [(2500, 896), (77, 64), (3, 2048 + 5), (0, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_backward_is_the_float64_gradient(kernels, rows: int, width: int, with_residual: bool):
    """2500 x 896: each program takes 8 rows in two passes of 4 (the last program's second pass is all masked), and
    the weight gradient sums 313 partial rows in ten blocks."""
    from shardrl.models.norm import rms_norm as reference_rms_norm

    g = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=g).bfloat16()
    w = (torch.rand(width, generator=g) + 0.5).bfloat16()
    grad = torch.randn(rows, width, generator=g).bfloat16()
    residual = torch.randn(rows, width, generator=g).bfloat16() if with_residual else None
    grad_x, grad_w = kernels["norm_kernel"].rms_norm_backward(grad, x, w, 1e-6, residual)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    loss = (reference_rms_norm(x64, w64, 1e-6) * grad.double()).sum()
    if with_residual:
        loss = loss + (x64 * residual.double()).sum()
    loss.backward()
    assert grad_x.dtype == grad_w.dtype == torch.bfloat16 and grad_x.shape == x.shape
    if rows:
        assert _relative_error(grad_x, x64.grad) < 1e-2 and _relative_error(grad_w, w64.grad) < 1e-2
        # Without the residual term the input gradient is clearly off: the test sees whether it was added.
        if with_residual:
            plain, _ = kernels["norm_kernel"].rms_norm_backward(grad, x, w, 1e-6)
            assert _relative_error(plain + residual, x64.grad) < 1e-2 < _relative_error(plain, x64.grad)
    else:
        assert torch.equal(grad_w, torch.zeros_like(grad_w))


def test_rms_norm_backward_of_strided_rows(kernels):
    """A norm's input can be a column slice (rows with a stride): the kernels read it like a contiguous copy."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(40, 700, generator=g).bfloat16()
    x, grad = wide[:, 100:612], torch.randn(40, 512, generator=g).bfloat16()
    w = (torch.rand(512, generator=g) + 0.5).bfloat16()
    strided = kernels["norm_kernel"].rms_norm_backward(grad, x, w, 1e-5)
    contiguous = kernels["norm_kernel"].rms_norm_backward(grad, x.contiguous(), w, 1e-5)
    assert all(map(torch.equal, strided, contiguous))


@pytest.mark.parametrize("bitwise", [False, True])
def test_rms_norm_module_in_a_residual_block_is_autograd_of_torch_ops(kernels, monkeypatch, bitwise):
    """The block a decoder layer builds, on the kernel path that CUDA takes (switched on here for CPU tensors):
    normed, h = norm.with_residual(x); out = final_norm(h + normed @ W). Forward, x's gradient (through the
    normalisation and the residual stream) and both weights' gradients against the same block in float64."""
    from shardrl.models.norm import RMSNorm, rms_norm as reference_rms_norm

    monkeypatch.setattr(RMSNorm, "_runs_kernel", lambda self, x: True)
    g = torch.Generator().manual_seed(7)
    tokens, width = 50, 256
    x = torch.randn(tokens, width, generator=g).bfloat16()
    proj = (torch.randn(width, width, generator=g) / width ** 0.5).bfloat16()
    upstream = torch.randn(tokens, width, generator=g).bfloat16()
    norms = [RMSNorm(width, 1e-6, f"norm{i}", dtype=torch.bfloat16, bitwise=bitwise) for i in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(width, generator=g) + 0.5)
    leaf = x.clone().requires_grad_()
    normed, h = norms[0].with_residual(leaf)
    assert type(normed.grad_fn).__name__ == "_KernelRMSNormBackward"
    out = norms[1](h + normed @ proj)
    (out * upstream).sum().backward()
    with torch.no_grad():  # the pass without autograd (old log-probs) sees the training pass's activations
        assert torch.equal(norms[0](x), normed) and (bitwise or torch.equal(normed, reference_rms_norm(
            x, norms[0].weight, 1e-6)))

    x64 = x.double().requires_grad_()
    weights64 = [norm.weight.detach().double().requires_grad_() for norm in norms]
    out64 = reference_rms_norm(x64 + reference_rms_norm(x64, weights64[0], 1e-6) @ proj.double(), weights64[1], 1e-6)
    (out64 * upstream.double()).sum().backward()
    assert _relative_error(out, out64) < 1e-2 and _relative_error(leaf.grad, x64.grad) < 2e-2
    for norm, weight64 in zip(norms, weights64):
        assert _relative_error(norm.weight.grad, weight64.grad) < 2e-2


def test_rms_norm_forward_rows_do_not_depend_on_the_batch(kernels):
    from shardrl.models.norm import rms_norm as reference_rms_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 896, generator=g).bfloat16()
    w = (torch.rand(896, generator=g) + 0.5).bfloat16()
    full = kernels["norm_kernel"].rms_norm(x, w, 1e-6)
    assert torch.equal(kernels["norm_kernel"].rms_norm(x[7:9], w, 1e-6), full[7:9])
    assert _relative_error(full, reference_rms_norm(x.double(), w.double(), 1e-6)) < 1e-2


# --- elementwise kernels: SwiGLU, rotary, the fp32 gradient add ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_is_silu_gate_times_up(kernels, dtype):
    from shardrl.parallel.activation import swiglu

    g = torch.Generator().manual_seed(2)
    packed = (torch.randn(37, 2 * 1029, generator=g) * 3).to(dtype)  # gate and up: column slices of one output
    grad_out = torch.randn(37, 1029, generator=g).to(dtype)
    gate, up = (t.detach().requires_grad_() for t in packed.split(1029, dim=-1))
    out = kernels["swiglu_kernel"].fused_swiglu(gate, up)
    out.backward(grad_out)
    ref_gate, ref_up = (t.detach().double().requires_grad_() for t in packed.split(1029, dim=-1))
    ref = swiglu(ref_gate, ref_up)
    ref.backward(grad_out.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    for got, want in ((out, ref), (gate.grad, ref_gate.grad), (up.grad, ref_up.grad)):
        assert got.dtype == dtype
        assert_close(got.double(), want.to(dtype).double(), **tol)


@pytest.mark.parametrize("shape", [(37, 5, 64), (9, 3, 8), (6, 16, 80)])
def test_rotary_kernel_is_apply_rope(kernels, shape):
    from shardrl.models.config import RopeConfig
    from shardrl.models.rope import RotaryEmbedding, apply_rope

    num_tokens, num_heads, head_dim = shape
    g = torch.Generator().manual_seed(sum(shape))
    positions = torch.randperm(4096, generator=g)[:num_tokens]
    cos, signed_sin = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, torch.device("cpu"))(positions)
    packed = torch.randn(num_tokens, (num_heads + 2) * head_dim, generator=g)
    x = packed[:, head_dim:-head_dim].unflatten(-1, (num_heads, head_dim)).requires_grad_()  # strided, as q is
    grad_out = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    out = kernels["rope_kernel"].rotary(x, cos, signed_sin)
    out.backward(grad_out)
    ref_x = x.detach().double().requires_grad_()
    ref = apply_rope(ref_x, cos.double(), signed_sin.double())
    ref.backward(grad_out.double())
    assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    assert_close(x.grad.double(), ref_x.grad, rtol=1e-6, atol=1e-6)


def test_add_into_fp32_adds_every_element(kernels):
    g = torch.Generator().manual_seed(3)
    main = torch.randn(5000, generator=g)
    grad = torch.randn(5000, generator=g).bfloat16()
    expected = main + grad.float()
    kernels["grad_add_kernel"].add_into_fp32(main, grad)
    assert torch.equal(main, expected)


# --- MoE row moves and the vocab-parallel log-prob kernels ---------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 2, 100), (33, 4, 1024 + 3), (0, 2, 64)])
def test_moe_row_kernels_are_the_portable_path(kernels, shape):
    from shardrl.parallel.moe_rows import combine_backward_reference, gather_sum_reference

    num_tokens, top_k, hidden = shape
    g = torch.Generator().manual_seed(hidden)
    order = torch.randint(0, 16, (num_tokens * top_k,), generator=g).argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    y = torch.randn(num_tokens * top_k, hidden, generator=g)
    weights = torch.rand(num_tokens, top_k, generator=g)
    grad = torch.randn(num_tokens, hidden, generator=g)
    index = inverse.view(num_tokens, top_k)
    moe = kernels["moe_rows_kernel"]
    for got, want in ((moe.gather_sum(y, index, weights), gather_sum_reference(y.double(), index, weights.double())),
                      (moe.gather_sum(y, index, None), gather_sum_reference(y.double(), index, None)),
                      *zip(moe.combine_backward(grad, y, index, weights),
                           combine_backward_reference(grad.double(), y.double(), order, inverse, weights.double()))):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 100, 100), (5, 3 * 4096, 3 * 4096 - 77)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_kernels_are_the_torch_reference(kernels, shape, dtype):
    from shardrl.parallel.vocab import logits_grad_reference, softmax_stats_reference

    num_tokens, num_cols, num_valid = shape
    g = torch.Generator().manual_seed(num_cols)
    logits = (torch.randn(num_tokens, num_cols, generator=g) * 4).to(dtype)
    vocab = kernels["vocab_kernels"]
    stats = vocab.block_stats(logits[:, :num_valid], num_valid)
    expected = softmax_stats_reference(logits[:, :num_valid].double(), 2**26)
    assert torch.equal(stats[0].double(), expected[0].double())  # the max is exact
    assert_close(stats[1].double(), expected[1].double(), rtol=1e-5, atol=0)
    assert_close((stats[2] / stats[1]).double(), (expected[2] / expected[1]).double(), rtol=1e-5, atol=1e-5)
    log_norm, mean_z = (expected[0] + expected[1].log()).float(), (expected[2] / expected[1]).float()
    targets = torch.randint(0, num_valid, (num_tokens,), generator=g)
    mine = torch.rand(num_tokens, generator=g) < 0.7  # the rest: another rank holds the target
    for use_logprob, use_entropy in ((True, True), (True, False), (False, True)):
        up_logprob = torch.randn(num_tokens, generator=g) if use_logprob else None
        up_entropy = torch.randn(num_tokens, generator=g) if use_entropy else None
        got = vocab.block_grad(logits, log_norm, mean_z, up_logprob, up_entropy,
                               torch.where(mine, targets, -1).int(), num_valid)
        want = logits_grad_reference(logits, log_norm, mean_z, up_logprob, up_entropy, targets.unsqueeze(-1), mine,
                                     num_valid, 2**26)
        assert got.dtype == dtype and torch.all(got[:, num_valid:] == 0)
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
        assert_close(got.float(), want.float(), **tol)


# --- kernels with tl.dot: bitwise mode's GEMMs and attention, decode attention -----------------------------------
# In fp16: the interpreter keeps bf16 as raw 16-bit integers (numpy has none) and its tl.dot multiplies those. The
# kernels' code does not depend on which 16-bit float it reads; the GPU tests run them in bf16.
HALF = torch.float16


def test_bitwise_matmuls_match_linear_and_do_not_depend_on_the_batch(kernels):
    bk = kernels["bitwise_kernels"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 96, generator=g).to(HALF)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(HALF)
    b = torch.randn(80, generator=g).to(HALF)
    full = bk.matmul(x, w, b)
    assert _relative_error(full, F.linear(x.double(), w.double(), b.double())) < 1e-2
    for rows in (slice(0, 1), slice(3, 19), slice(3, 70), slice(20, 150)):  # 16-, 64- and 128-row tiles
        assert torch.equal(bk.matmul(x[rows], w, b), full[rows])
    assert torch.equal(bk.matmul(x, w[:48]), bk.matmul(x, w)[:, :48])
    experts = (torch.randn(4, 48, 96, generator=g) * 0.1).to(HALF)
    for counts in ([150, 0, 0, 0], [1, 60, 0, 89], [0, 0, 0, 150]):
        tiles = bk.expert_tiles(torch.tensor(counts), x.shape[0], 16)
        assert tiles.expert_end.tolist() == torch.tensor(counts).cumsum(0).tolist()
        out = bk.grouped_matmul(x, experts, tiles)
        pair = bk.grouped_matmul_pair(x, experts, experts.flip(0), tiles)
        assert torch.equal(pair[0], out) and torch.equal(pair[1], bk.grouped_matmul(x, experts.flip(0), tiles))
        start = 0
        for expert, count in enumerate(counts):
            assert torch.equal(out[start:start + count], bk.matmul(x[start:start + count], experts[expert])), counts
            start += count


def test_bitwise_attention_matches_the_reference_and_decodes_query_by_query(kernels):
    from shardrl.models.attention import reference_attention

    attention = kernels["bitwise_kernels"].attention
    g = torch.Generator().manual_seed(1)
    lengths = [1, 17, 40, 5]
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    total = int(cu[-1])
    q = torch.randn(total, 4, 16, generator=g).to(HALF)
    k = torch.randn(total, 2, 16, generator=g).to(HALF)
    v = torch.randn(total, 2, 16, generator=g).to(HALF)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    lse = torch.empty(4, total)
    packed = attention(q, k, v, starts, lens, torch.zeros_like(starts), starts, max(lengths), 0.25, lse, block_m=16)
    assert _relative_error(packed, reference_attention(q.double(), k.double(), v.double(), cu, 0.25)) < 2e-2
    scores = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(2, 1)) * 0.25
    token = torch.arange(total)
    segment = torch.searchsorted(cu[1:], token.int(), right=True)
    visible = (segment[:, None] == segment[None, :]) & (token[None, :] <= token[:, None])
    assert_close(lse.double(), scores.masked_fill(~visible, float("-inf")).logsumexp(-1), atol=1e-3, rtol=0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens.long())
    positions = (torch.arange(total) - cu[seq]).int()
    rows = torch.arange(total, dtype=torch.int32)
    one_by_one = attention(q, k, v, rows, torch.ones_like(rows), positions, cu[seq].int(), 1, 0.25, block_m=16)
    assert torch.equal(one_by_one, packed)



@pytest.mark.parametrize("splits", [1, 3])
def test_split_kv_decode_attention_reads_only_each_rows_tokens(kernels, monkeypatch, splits):
    """Garbage (NaN) past each row's length, more cache slots than rows; with splits > 1 the partial results merge
    into the softmax over the whole row (the split count comes from the GPU's SM count, so it is set here)."""
    from shardrl.rollout.kv_cache import reference_decode_attention

    decode = kernels["decode_attention"]
    monkeypatch.setattr(decode, "num_splits_for", lambda *args: splits)
    g = torch.Generator().manual_seed(1)
    num_rows, num_heads, num_kv, dim, max_len = 5, 4, 2, 16, 96
    q = torch.randn(num_rows, num_heads, dim, generator=g).to(HALF)
    keys = torch.randn(num_rows + 2, max_len, num_kv, dim, generator=g).to(HALF)
    values = torch.randn(num_rows + 2, max_len, num_kv, dim, generator=g).to(HALF)
    positions = torch.tensor([0, 1, max_len - 1, 7, 50])
    past = torch.arange(max_len) > positions.unsqueeze(1)
    keys[:num_rows][past], values[:num_rows][past] = float("nan"), float("nan")
    got = decode.split_kv_decode_attention(q, keys, values, (positions + 1).int(), max_len, scale=0.25)
    expected = reference_decode_attention(q.float(), keys[:num_rows].float().nan_to_num().transpose(1, 2),
                                          values[:num_rows].float().nan_to_num().transpose(1, 2), ~past, scale=0.25)
    assert got.dtype == HALF and got.shape == (num_rows, num_heads, dim)
    assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)



# --- the fused sampler ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale,raw", [(True, True), (False, False)])
def test_fused_sampler_draws_each_rows_inverse_cdf(kernels, scale, raw):
    """Each drawn token's range of the fp64 CDF holds the row's uniform (the counter hash for seeded rows, the
    shared draw for the others), logprobs are fp64 log-softmax's, greedy rows take the argmax."""
    from shardrl.rollout.request import SamplingParams
    from shardrl.rollout.sampler import SamplingBatch, row_uniforms

    rows, vocab = 12, 5000  # two chunks of the first launch, the second partial
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab + 8, generator=g) * 3)[:, :vocab]  # row stride != vocab
    temperatures = [[1.0, 0.7, 0.0, 1.3][i % 4] if scale else [1.0, 0.0][i % 2] for i in range(rows)]
    params = [SamplingParams(temperature=t, raw_logprobs=raw) for t in temperatures]
    batch = SamplingBatch.build(params, [1000 + i if i % 2 else None for i in range(rows)], vocab,
                                torch.device("cpu"))
    counters = torch.randint(0, 2**31, (rows,), generator=g)
    drawn = torch.rand(rows, generator=torch.Generator().manual_seed(7))
    tokens, logprobs, raw_logprobs = kernels["sample_kernel"].fused_sample(
        logits, batch.temperature, batch.greedy, batch.has_seed, batch.keys, counters, drawn, scale, raw)
    scaled = logits.double() / torch.tensor([t or 1.0 for t in temperatures], dtype=torch.float64).unsqueeze(1)
    logp = scaled.log_softmax(-1)
    at = torch.arange(rows)
    assert_close(logprobs.double(), logp[at, tokens], atol=2e-5, rtol=0)
    if raw:
        assert_close(raw_logprobs.double(), logits.double().log_softmax(-1)[at, tokens], atol=2e-5, rtol=0)
    assert torch.equal(tokens[batch.greedy], logits[batch.greedy].argmax(-1))
    upper = logp.exp().cumsum(-1)[at, tokens]
    lower = upper - logp[at, tokens].exp()
    u = row_uniforms(batch, counters, torch.Generator().manual_seed(7)).double()
    assert ((lower - 1e-5 <= u) & (u < upper + 1e-5))[~batch.greedy].all()


# --- weight sync's checksum -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_bytes", [8, 13 * 8, 3 * 4096 + 40])
def test_checksum_kernel_equals_the_torch_path(kernels, num_bytes):
    """The block sums of the kernel, salt included, equal `verify.checksum`'s torch path bit for bit (ragged last
    block, a salt from a large identity) and change with one flipped bit."""
    from shardrl.sync import verify

    def kernel_checksum(data: torch.Tensor, identity: int, version: int) -> torch.Tensor:
        words = data.view(torch.int64)
        return kernels["checksum_kernel"].salted_block_sums(
            words, verify.multipliers(words.device), -(-words.numel() // verify.BLOCK_WORDS), verify.BLOCK_WORDS,
            verify._seed(identity, version), verify._GOLDEN, verify._MIX)

    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for identity, version in ((0, 0), (2**62 + 12345, 9)):
        assert torch.equal(kernel_checksum(data, identity, version), verify.checksum(data, identity, version))
    flipped = data.clone()
    flipped[num_bytes // 2] ^= 0x20
    assert not torch.equal(kernel_checksum(flipped, 0, 0), verify.checksum(data))
