"""The segmented LoRA product (xllm.kernels.lora): the native kernel (kernels/cpu/lora.c) and the torch loop
against an fp64 oracle computed row by row from the same weights, over unfused and fused (qkv-like 3 parts of
different sizes, gate_up-like 2 parts) layouts, ranks below the stack's (zero padded), rows of the base model
(slot -1, left bit for bit), one slot for every row, 16 distinct slots, 1 and 37 rows."""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import lora, native

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")

IN = 72  # not a multiple of 32: the bf16 dot's tails
# name -> part output sizes (not multiples of 16 or 64: the expand's masked tails)
LAYOUTS = {"unfused": (88,), "qkv": (72, 24, 24), "gate_up": (80, 80), "qkv_32": (96, 32, 32)}
# name -> (rows, slots per row as a function of the row index, adapter slots)
ROWS = {
    "one_row": (1, lambda t: 2, 4),
    "mixed_37": (37, lambda t: (t % 5) - 1, 4),  # -1 (base model) rows between the others
    "all_one_slot": (37, lambda t: 1, 4),
    "sixteen_slots": (37, lambda t: t % 17 - 1, 16),
}


def _case(layout: str, rows: str, r_max: int, dtype: torch.dtype, seed: int = 0):
    """x, out (the base output), A, B, LoraRows, LoraLayout: each slot an adapter of its own rank <= r_max
    (zero padded), A ``[slots, parts * r_max, in]``, B ``[slots, out, r_max]`` (each output row's own part's
    columns), as xllm.models.lora.LoraStack holds them."""
    g = torch.Generator().manual_seed(seed)
    sizes = LAYOUTS[layout]
    n_rows, slot_of, n_slots = ROWS[rows]
    out_dim, n = sum(sizes), len(sizes) * r_max
    a = torch.zeros(n_slots, n, IN)
    b = torch.zeros(n_slots, out_dim, r_max)
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    for s in range(n_slots):
        r = 1 + (s * 5) % r_max  # its own rank, below r_max for most slots
        for p, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            a[s, p * r_max:p * r_max + r] = torch.randn(r, IN, generator=g) / IN ** 0.5
            b[s, start:start + size, :r] = torch.randn(size, r, generator=g)
    scales = [0.3 + 0.37 * s for s in range(n_slots)]  # not bf16 numbers: index_add_ rounds alpha
    slots = torch.tensor([slot_of(t) for t in range(n_rows)], dtype=torch.int64)
    x = torch.randn(n_rows, IN, generator=g)
    out = torch.randn(n_rows, out_dim, generator=g)
    parts = [(p, start, size) for p, (start, size) in enumerate(zip(starts, sizes, strict=True))]
    return (x.to(dtype), out.to(dtype), a.to(dtype), b.to(dtype), lora.LoraRows.of(slots, scales),
            lora.LoraLayout.of(r_max, parts))


def _dense(b, lay):
    """B ``[slots, out, rank]`` as the dense ``[slots, out, parts * rank]`` (zero outside each row's part)."""
    dense = torch.zeros(b.shape[0], b.shape[1], lay.n_parts * lay.rank, dtype=torch.float64)
    for p, (start, size) in enumerate(zip(lay.starts, lay.sizes, strict=True)):
        dense[:, start:start + size, p * lay.rank:(p + 1) * lay.rank] = b[:, start:start + size].double()
    return dense


def _oracle(x, out, a, b, rows, lay):
    """fp64, row by row: the exact result and, per element, the size of what the rounding of ``x @ A^T``
    and of the output can change (``|out|`` and ``scale * sum_k |h_k B_jk|``)."""
    want, mag = out.double().clone(), out.double().abs()
    dense = _dense(b, lay)
    for t, s in enumerate(rows.slots.tolist()):
        if s < 0:
            continue
        h = a[s].double() @ x[t].double()
        scale = float(rows.scales[s])
        want[t] += scale * (dense[s] @ h)
        mag[t] = want[t].abs() + scale * (dense[s].abs() @ h.abs())
    return want, mag


def _assert_close(got, x, out, a, b, rows, lay, dtype, ulps: float):
    want, mag = _oracle(x, out, a, b, rows, lay)
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    err = (got.double() - want).abs()
    bound = ulps * eps * mag + 1e-6
    assert (err <= bound).all(), f"max error {err.max().item():.3g} over bound at {(err / bound).argmax().item()}"
    base = rows.slots < 0
    assert torch.equal(got[base], out[base]), "rows of the base model (slot -1) changed"


CASES = pytest.mark.parametrize("layout,rows", [(la, ro) for la in LAYOUTS for ro in ROWS])
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
RANKS = pytest.mark.parametrize("r_max", [8, 20])  # 20: two blocks of 16 in the expand's transposes


@needs_native
@CASES
@DTYPES
@RANKS
def test_native_kernel_matches_fp64_oracle(layout, rows, dtype, r_max):
    x, out, a, b, lrows, lay = _case(layout, rows, r_max, dtype)
    got = out.clone()
    assert lora.native_segmented_lora(x, got, a, b, lrows, lay), "the native kernel did not run"
    # bf16: h, the delta, the scale and the output each rounded once (each <= 2^-8 relative), fp32 sums
    _assert_close(got, x, out, a, b, lrows, lay, dtype, ulps=4.0 if dtype == torch.bfloat16 else 64.0)


@CASES
@DTYPES
@RANKS
def test_torch_loop_matches_fp64_oracle(layout, rows, dtype, r_max):
    x, out, a, b, lrows, lay = _case(layout, rows, r_max, dtype)
    got = lora.torch_segmented_lora(x, out.clone(), a, b, lrows, lay)
    # bf16: as the kernel, and index_add_ rounds alpha * delta once more in its last (< 32) columns
    _assert_close(got, x, out, a, b, lrows, lay, dtype, ulps=5.0 if dtype == torch.bfloat16 else 64.0)


@needs_native
@DTYPES
@pytest.mark.parametrize("r_max", [8, 16])
def test_native_kernel_has_the_torch_loops_rounding(dtype, r_max):
    """The kernel rounds where the torch loop rounds (h, the delta, the scale, the output: torch's index_add_
    in 32-column vectors): on parts of multiples of 32 columns the two agree bit for bit but where the order of
    their fp32 sums flips a rounding (rare; here none on an AVX-512 CPU), fp32 up to that order."""
    x, out, a, b, rows, lay = _case("qkv_32", "sixteen_slots", r_max, dtype, seed=3)
    got, ref = out.clone(), out.clone()
    assert lora.native_segmented_lora(x, got, a, b, rows, lay)
    lora.torch_segmented_lora(x, ref, a, b, rows, lay)
    assert not torch.equal(got, out)
    if dtype == torch.bfloat16:
        assert (got == ref).double().mean().item() >= 0.99
        _assert_close(got, x, out, a, b, rows, lay, dtype, ulps=4.0)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_segmented_lora_takes_either_path(monkeypatch, native_on):
    """segmented_lora gives the oracle's result with the native library and without it (XLLM_NATIVE=0's
    semantics: native.for_tensors answers None), and on a non-contiguous input (the torch loop)."""
    if native_on and native.unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    if not native_on:
        monkeypatch.setattr(native, "for_tensors", lambda *tensors: None)
    x, out, a, b, rows, lay = _case("gate_up", "mixed_37", 8, torch.bfloat16, seed=7)
    got = out.clone()
    assert lora.segmented_lora(x, got, a, b, rows, lay) is got
    _assert_close(got, x, out, a, b, rows, lay, torch.bfloat16, ulps=5.0)
    wide = torch.zeros(x.shape[0], 2 * IN, dtype=x.dtype)
    wide[:, ::2] = x
    got2 = out.clone()
    assert not lora.native_segmented_lora(wide[:, ::2], got2, a, b, rows, lay)
    lora.segmented_lora(wide[:, ::2], got2, a, b, rows, lay)
    _assert_close(got2, x, out, a, b, rows, lay, torch.bfloat16, ulps=5.0)


def test_rows_groups_and_shape_checks():
    rows = lora.LoraRows.of(torch.tensor([2, -1, 0, 2, -1]), [0.5, 1.0, 2.0])
    assert [(s, idx.tolist(), sc) for s, idx, sc in rows.groups] == [(0, [2], 0.5), (2, [0, 3], 2.0)]
    assert rows.scales.dtype == torch.float32 and rows.scales.tolist() == [0.5, 1.0, 2.0]
    assert (rows.order.tolist(), rows.gslot.tolist(), rows.gstart.tolist()) == ([2, 0, 3], [0, 2], [0, 1, 3])
    x, out, a, b, lrows, lay = _case("qkv", "mixed_37", 8, torch.float32)
    with pytest.raises(ValueError, match="do not fit together"):
        lora.segmented_lora(x[:, :-1], out, a, b, lrows, lay)
    with pytest.raises(ValueError, match=r"indexed 0\.\.n-1"):
        lora.LoraLayout.of(8, [(1, 0, 4)])
