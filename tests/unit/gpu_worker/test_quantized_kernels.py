"""The group-wise int4 and FP8 kernels (``quant_linear.cpp``) and the W8A8 matmul: each
dequantizes bitwise as its torch path, multiplies within float rounding of the dequantized
weight in fp32, and gives a row bitwise the same result in every batch of 1..32 rows, at
any position, at 1 and 2 threads (the GGML types: ``test_quantized_ggml.py``)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.quantization import fp8, int4, int8, kernels

N, K, BIG = 45, 256, 32  # 45 features: a partial work item of 4


def _kernel():
    k = kernels.load()
    assert k is not None, "the quantized-matmul kernel did not build"
    return k


def _int4(group: int):
    gen = torch.Generator().manual_seed(0)
    qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    scales = torch.rand(N, K // group, generator=gen) * 0.02
    zeros = torch.randint(0, 16, (N, K // group), generator=gen).float()
    w = int4.dequantize(qs, scales, zeros, group)
    return w, lambda x, out: _kernel().int4_linear(x, qs, scales, zeros, group, out), \
        _kernel().int4_dequantize(qs, scales, zeros, group)


def _fp8(block: tuple[int, int]):
    gen = torch.Generator().manual_seed(1)
    wf = torch.randn(N, K, generator=gen)
    bits = wf.to(torch.float8_e4m3fn).view(torch.uint8)
    bn, bk = block
    scales = torch.rand(-(-N // bn), -(-K // bk), generator=gen) + 0.5
    w = fp8.dequantize(bits, scales, block)
    return w, lambda x, out: _kernel().fp8_linear(x, bits, scales, bn, bk, out), \
        _kernel().fp8_dequantize(bits, scales, bn, bk)


CASES = {"int4-g32": lambda: _int4(32), "int4-g128": lambda: _int4(128), "int4-row": lambda: _int4(K),
         "fp8-channel": lambda: _fp8((1, K)), "fp8-block": lambda: _fp8((16, 64))}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_is_the_dequantized_product_and_batch_invariant(case, threads):
    w, linear, dequantized = CASES[case]()
    assert torch.equal(dequantized, w)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BIG, K, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def run(rows):
            out = torch.empty(rows.shape[0], N)
            linear(rows.contiguous(), out)
            return out

        ref = run(x)
        torch.testing.assert_close(ref, x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-4)
        for m in range(1, BIG + 1):
            rows = torch.randperm(BIG, generator=gen)[:m]
            assert torch.equal(run(x[rows]), ref[rows]), m
    finally:
        torch.set_num_threads(before)


def test_e4m3_bytes_read_as_torch_reads_them():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)  # each byte once
    got = _kernel().fp8_dequantize(every, torch.ones(1, 1), 1, 256)
    want = every.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()  # (0x7F and 0xFF, e4m3fn's NaNs, are no weight)
    assert finite.sum() == 254 and torch.equal(got[finite], want[finite])


def test_w8a8_rows_do_not_depend_on_the_batch():
    class Layer:
        in_features, out_features, input_shards = K, N, 1

    layer = Layer()
    gen = torch.Generator().manual_seed(3)
    layer.weight = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    layer.weight_scale = torch.rand(N, 1, generator=gen) * 0.01
    method = int8.Int8Linear()
    x = torch.randn(BIG, K, generator=gen)
    ref = method.apply(layer, x, None)
    xq, sx = int8.quantize_rows(layer, x)
    torch.testing.assert_close(ref, (xq.float() * sx) @ (layer.weight.float() * layer.weight_scale).T,
                               rtol=1e-5, atol=1e-4)
    for m in range(1, BIG + 1):
        rows = torch.randperm(BIG, generator=gen)[:m]
        assert torch.equal(method.apply(layer, x[rows], None), ref[rows]), m
