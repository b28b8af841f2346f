"""The native packed GEMM (kernels/cpu/gemm_packed.{h,c}) against a float32 torch oracle, and the
per-shape choice between it and oneDNN."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch

from xllm.kernels import gemm, gemm_choice, linear, native

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable")

MS = (1, 7, 9, 16, 33, 100, 257)
VP, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


def _check(y: torch.Tensor, ref: torch.Tensor, bf16_out: bool, k: int = 64) -> None:
    """fp32 sums in another order than the oracle's: noise growing like sqrt(k) (2e-5 at k = 64)"""
    atol = 2e-5 * max(1.0, (k / 64) ** 0.5)
    if bf16_out:  # one rounding of the fp32 sum to bf16: half an ulp (2^-9 relative) plus fp32 noise
        torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-3)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(100, 64), (49, 32), (1, 96), (144, 130)])
def test_packed_matches_oracle(dtype, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    pw = gemm.pack(w)
    assert pw is not None and pw.data.numel() == gemm.numel(n, k) >= n * k
    for m in MS:
        x = torch.randn(m, k, generator=gen).to(dtype)
        for bias in (None, b):
            _check(gemm.packed_linear(x, pw, bias), _oracle(x, w, bias), dtype == torch.bfloat16)
    if dtype == torch.bfloat16:  # fp32 output of a bf16 product: no output rounding
        x = torch.randn(33, k, generator=gen).to(dtype)
        y = gemm.packed_linear(x, pw, b, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        _check(y, _oracle(x, w, b), False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strides_and_team_entry(dtype):
    """Row strides of x and y through the strided entry (the TEAM function inside its own parallel
    region); columns of y outside [0, N) stay untouched."""
    gen = torch.Generator().manual_seed(7)
    m, n, k, ldx, ldy = 37, 70, 64, 96, 80
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    xs = torch.randn(m, ldx, generator=gen).to(dtype)
    pw = gemm.pack(w)
    lib = native.library()
    if dtype == torch.bfloat16:
        y = torch.full((m, ldy), 7.0, dtype=torch.float32)
        lib.fn("xllm_gemm_packed_strided_bf16", [VP, I64, I64, I64, VP, I64, VP, VP, I64, I32])(
            xs.data_ptr(), ldx, m, k, pw.data_ptr(), n, b.data_ptr(), y.data_ptr(), ldy, 0)
    else:
        y = torch.full((m, ldy), 7.0, dtype=torch.float32)
        lib.fn("xllm_gemm_packed_strided_f32", [VP, I64, I64, I64, VP, I64, VP, VP, I64])(
            xs.data_ptr(), ldx, m, k, pw.data_ptr(), n, b.data_ptr(), y.data_ptr(), ldy)
    _check(y[:, :n], _oracle(xs[:, :k], w, b), False)
    assert torch.equal(y[:, n:], torch.full((m, ldy - n), 7.0))
    # the Python wrapper takes a row-strided x view too
    _check(gemm.packed_linear(xs[:, :k], pw, b), _oracle(xs[:, :k], w, b), dtype == torch.bfloat16)


@pytest.mark.parametrize("path", ["avx512", "amx"])
@pytest.mark.parametrize("n,k", [(100, 64), (49, 32), (60, 576), (200, 1536)])
def test_bf16_kernels_match_oracle(path, n, k):
    """Each bf16 kernel forced (the automatic choice takes AMX from 2 rows where it runs): the row counts
    around its 16-row blocks (a padded block below 16 rows, a last block shifted back above), the M-blocks
    of a long x (600 rows of K 1536 are two with a 2 MB L2, three at the 256 KB floor), the next panel's
    prefetch across them, the model's K of 576, a row-strided x, fp32 and bf16 outputs."""
    if path == "amx" and not gemm.amx_ready():
        pytest.skip("no AMX here")
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    pw = gemm.pack(w)
    for m in (1, 2, 15, 16, 17, 31, 33, 600):
        xs = torch.randn(m, k + 32, generator=gen).bfloat16()
        x = xs[:, 16:16 + k]
        _check(gemm.packed_linear(x, pw, b, out_dtype=torch.float32, path=path), _oracle(x, w, b), False, k)
        _check(gemm.packed_linear(x, pw, None, path=path), _oracle(x, w, None), True)
        # widen: the bf16 output's float32 widening, written by the kernel (bit for bit)
        wide = gemm.packed_linear(x, pw, b, path=path, widen=True)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, gemm.packed_linear(x, pw, b, path=path).float())


def test_amx_contract():
    """The AMX kernel needs K % 32 == 0: forcing it elsewhere is an error, the automatic path runs AVX-512."""
    if not gemm.amx_ready():
        pytest.skip("no AMX here")
    w = torch.randn(20, 48).bfloat16()
    x = torch.randn(5, 48).bfloat16()
    pw = gemm.pack(w)
    with pytest.raises(ValueError, match="amx"):
        gemm.packed_linear(x, pw, path="amx")
    _check(gemm.packed_linear(x, pw), _oracle(x, w, None), True)


def test_plain_entry_and_contract():
    w = torch.randn(50, 64).bfloat16()
    x = torch.randn(20, 64).bfloat16()
    pw = gemm.pack(w)
    y = torch.empty(20, 50, dtype=torch.bfloat16)
    native.library().fn("xllm_gemm_packed_bf16", [VP, I64, I64, VP, I64, VP, VP, I32])(
        x.data_ptr(), 20, 64, pw.data_ptr(), 50, None, y.data_ptr(), 1)
    _check(y, _oracle(x, w, None), True)
    assert gemm.pack(torch.randn(8, 63).bfloat16()) is None  # bf16 needs an even K
    assert gemm.pack(torch.randn(8, 63)) is not None
    with pytest.raises(ValueError):
        gemm.packed_linear(torch.randn(4, 64), pw)  # dtype mismatch


def test_linear_routes_by_choice():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(40, 64, generator=gen).bfloat16()
    pw = gemm.pack(w)
    ref = _oracle(x, w, b)
    native_first = gemm_choice.GemmChoice((16, 64), (False, True))  # 40 rows -> bucket 64 -> native
    y = linear(x, w, b, native_packed=pw, choice=native_first)
    assert torch.equal(y, gemm.packed_linear(x, pw, b))
    onednn = gemm_choice.forced(False)
    _check(linear(x, w, b, packed=None, native_packed=pw, choice=onednn), ref, True)  # no oneDNN copy: native
    _check(linear(x, w, b), ref, True)


def test_choice_is_measured_once_and_cached(tmp_path, monkeypatch):
    native.library()  # built (or loaded) before the cache root moves
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(gemm_choice.FORCE_ENV, raising=False)
    monkeypatch.setattr(gemm_choice, "BUCKETS", (16, 32))
    monkeypatch.setattr(gemm_choice, "_BUCKET_BUDGET_S", 0.0)
    w = torch.randn(64, 64).bfloat16()
    first = gemm_choice.measure(w, buckets=(16, 32), bucket_budget_s=0.0)
    assert first is not None and first.buckets == (16, 32) and len(first.ratios) == 2
    choice = gemm_choice.choose(w)
    files = list((tmp_path / "kernels").glob("gemm-choice-*.json"))
    assert choice is not None and len(files) == 1
    table = json.loads(files[0].read_text())
    assert set(table) == {"bf16:64x64"}
    # a second call reads the file instead of measuring again: an edited entry comes back as is
    table["bf16:64x64"]["native_faster"] = [True, False]
    files[0].write_text(json.dumps(table))
    again = gemm_choice.choose(w)
    assert again.native_faster == (True, False) and again.use_native(9) and not again.use_native(4096)
    monkeypatch.setenv(gemm_choice.FORCE_ENV, "onednn")
    assert not gemm_choice.choose(w).any_native


@pytest.mark.parametrize("native_choice", [True, False])
def test_linear_widen_is_float_of_output(native_choice):
    """``linear(..., widen=True)`` (an LM head's logits) equals ``linear(...).float()`` bit for bit on every
    route a bf16 product takes: the skinny GEMV (1 row), the native packed GEMM (2-8 rows, and more where
    the choice says native, writing the widened values itself), oneDNN's copy (more rows, choice says
    oneDNN); with ``out_dtype`` it is refused."""
    from xllm.kernels.linear import pack_weight

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(200, 64, generator=gen).bfloat16()
    kw = {"native_packed": gemm.pack(w), "packed": pack_weight(w), "choice": gemm_choice.forced(native_choice)}
    for m in (1, 4, 40):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        wide = linear(x, w, widen=True, **kw)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, linear(x, w, **kw).float()), m
        # float32 inputs: the product is float32 already, on the GEMV and the packed route alike
        x32, w32 = x.float(), w.float()
        wide32 = linear(x32, w32, widen=True, native_packed=gemm.pack(w32))
        assert wide32.dtype == torch.float32 and torch.equal(wide32, linear(x32, w32, native_packed=gemm.pack(w32)))
    with pytest.raises(ValueError, match="widen"):
        linear(x, w, out_dtype=torch.float32, widen=True)
    # the choice's slack: oneDNN measured ahead by less than the conversion it leaves to do
    close = gemm_choice.GemmChoice((16, 64), (True, False), (0.8, 1.1))
    assert not close.use_native(40) and close.use_native(40, 1.2) and close.use_native(9)
    assert not gemm_choice.GemmChoice((16,), (False,), (None,)).use_native(9, 1.2)
