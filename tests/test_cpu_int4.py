"""The C matmul over 4-bit planes (models/cpu_int4.c) as a spec: the layout round-trips, the
activations are quantized as ``cpu_int4.quantize`` says (ties included), every output equals an
exact oracle where the arithmetic is exact, and a row's bits never depend on the other rows of the
call or on the thread count."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from turnkv import cbuild
from turnkv.models import cpu_int4

pytestmark = pytest.mark.skipif(cpu_int4.library() is None, reason=f"no C kernel: {cpu_int4.status()}")


def planes(n: int, k: int, p: int, seed: int, exact: bool):
    """``p`` random planes ``(u, scale, zero)`` of an ``[n, k]`` matrix, fp16-exact scales and
    zeros; ``exact``: powers of two and small integers, so every product and sum is exact."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(p):
        u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        if exact:
            s = 2.0 ** torch.randint(-3, 2, (n, k // 32), generator=gen).float()
            z = torch.randint(-8, 9, (n, k // 32), generator=gen).float()
        else:
            s = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
            z = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
        out.append((u, s, z))
    return out


def exact_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows that the C quantizes exactly: every group of 32 holds one +-127 (so its step is 1
    and ``q = x``), the rest small integers (so the sums stay within fp32's 24 bits)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (m, k), generator=gen)
    at = torch.randint(0, 32, (m, k // 32), generator=gen) + torch.arange(0, k, 32)
    sign = torch.randint(0, 2, (m, k // 32), generator=gen) * 2 - 1
    x.scatter_(1, at, 127 * sign)
    return x.to(torch.bfloat16)


def dequantized(x: torch.Tensor) -> torch.Tensor:
    """``q * d`` of ``cpu_int4.quantize`` (the product rounded to fp32, as the C's scaling of a
    sum by ``s * d`` is for ``s = 1``): the activations the C multiplies."""
    q, d = cpu_int4.quantize(x)
    return (q.float().view(q.shape[0], -1, 32) * d[..., None]).view(q.shape).double()


def oracle(x: torch.Tensor, pl) -> torch.Tensor:
    """fp64 ``x @ W.T`` with ``W = sum_p u s + z`` (per group of 32 columns)."""
    w = sum(
        u.double() * s.double().repeat_interleave(32, 1) + z.double().repeat_interleave(32, 1)
        for u, s, z in pl
    )
    return x.double() @ w.T


@pytest.mark.parametrize(("n", "k", "p"), [(40, 64, 1), (17, 96, 2), (160, 32, 1), (33, 1536, 1)])
def test_the_layout_round_trips(n, k, p):
    pl = planes(n, k, p, seed=n + k, exact=False)
    packed = cpu_int4.pack(pl, n, k)
    assert packed.shape == (-(-n // 16), k // 32, p, cpu_int4.PLANE_BYTES)
    s, z = cpu_int4.scales(packed, n)
    assert torch.equal(s, torch.stack([t[1] for t in pl])) and torch.equal(z, torch.stack([t[2] for t in pl]))
    want = sum(u.float() * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1) for u, s, z in pl)
    assert torch.equal(cpu_int4.values(packed, n), want)


@pytest.mark.parametrize(("n", "k", "p"), [(40, 64, 1), (17, 96, 2), (200, 128, 1), (33, 1536, 2)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 21])
def test_outputs_equal_an_exact_oracle(n, k, p, m):
    """Activations the quantization keeps exactly, power-of-two scales, integer zeros: every
    product and partial sum is an integer or a few binary places below fp32's 24 bits, so any
    misplaced nibble, scale, column, group, plane or row shows as a difference."""
    pl = planes(n, k, p, seed=7 * n + m, exact=True)
    x = exact_rows(m, k, seed=m)
    got = cpu_int4.mm(x, cpu_int4.pack(pl, n, k), n)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got.double(), oracle(x, pl))


@pytest.mark.parametrize(("n", "k", "p"), [(3072, 64, 1), (49, 576, 2)])
def test_a_rows_bits_do_not_depend_on_its_company_or_the_threads(n, k, p):
    """Each row of a 23-row call (blocks of 8, 8, 7 rows) is the same bits as that row alone, on
    one thread and on several (the columns cut differently), and close to fp64."""
    pl = planes(n, k, p, seed=3, exact=False)
    packed = cpu_int4.pack(pl, n, k)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        together = cpu_int4.mm(x, packed, n)
        torch.set_num_threads(1)
        for r in (0, 7, 8, 16, 22):
            assert torch.equal(cpu_int4.mm(x[r : r + 1], packed, n)[0], together[r]), r
        assert torch.equal(cpu_int4.mm(x[5:14], packed, n), together[5:14])
    finally:
        torch.set_num_threads(threads)
    want = oracle(dequantized(x), pl)
    assert float((together.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_activations_are_quantized_as_the_reference_says_ties_included():
    """An identity weight reads back ``q * d`` per input: the C's quantization equals
    ``cpu_int4.quantize`` bit for bit, on random rows (2K groups), on zero groups, and on halves,
    which round to even (a group whose largest value is 254 has step 2: 3 -> 1.5 -> 2, 5 -> 2.5 -> 2)."""
    k = 512
    eye = torch.eye(k, dtype=torch.uint8)
    packed = cpu_int4.pack([(eye, torch.ones(k, k // 32), torch.zeros(k, k // 32))], k, k)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(128, k, generator=gen) * torch.rand(128, 1, generator=gen) * 10).to(torch.bfloat16)
    x[0, :32] = 0
    x[1] = torch.arange(k).remainder(32).mul(2).sub(31).float()  # odd values
    x[1, ::32] = 254
    assert torch.equal(cpu_int4.mm(x, packed, k).double(), dequantized(x))
    q, d = cpu_int4.quantize(x[1:2])
    assert q[0, 1:6].tolist() == [-14, -14, -12, -12, -10] and d[0, 0] == 2  # -29/2, -27/2, ...
    assert q[0, 0] == 127 and (q[0, 1:32] % 2 == 0).all()


def test_rows_that_do_not_fit_the_weights_are_an_error_with_the_numbers():
    packed = cpu_int4.pack(planes(16, 64, 1, seed=0, exact=True), 16, 64)
    with pytest.raises(ValueError, match=r"rows of 64 values .* got torch.bfloat16 \[1, 96\]"):
        cpu_int4.mm(torch.zeros(1, 96, dtype=torch.bfloat16), packed, 16)
    with pytest.raises(ValueError, match=r"got torch\.float16"):
        cpu_int4.mm(torch.zeros(1, 64, dtype=torch.float16), packed, 16)
    with pytest.raises(ValueError, match="at most 16 outputs"):
        cpu_int4.mm(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 17)
    with pytest.raises(ValueError, match=r"residual must be fp32 \[2, 16\]"):
        cpu_int4.mm(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 16, residual=torch.zeros(1, 16))


def fp32_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """fp32 rows whose bf16 rounding has every case: random values, exact ties between two bf16
    values (odd and even), values that round up to a power of two, zeros, subnormals, infinities."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10
    bits = x.view(torch.int32)
    ties = torch.rand(m, k, generator=gen) < 0.3
    bits[ties] = (bits[ties] & ~0xFFFF) | 0x8000  # halfway: ties to even, both parities occur
    x[:, 5] = 1.9999999  # rounds up to 2
    x[:, 6] = 0.0
    x[:, 7] = -1e-40  # subnormal
    x[0, 40] = float("inf")  # a group of its own with an infinity: NaN/garbage alike in both
    return x


@pytest.mark.parametrize(("m", "q8"), [(1, False), (8, False), (13, True)])
def test_fp32_rows_give_the_bits_of_their_bf16_cast_and_the_residual_those_of_torch_add(m, q8):
    """The C rounds fp32 rows to bf16 as ``.bfloat16()`` does, so fp32 rows and their cast give the
    same bits; the residual it adds gives the bits of ``y + residual`` in torch."""
    n, k = 40, 96
    if q8:
        packed = cpu_int4.pack_q8(*q8_matrix(n, k, seed=m, exact=False), n, k)
    else:
        packed = cpu_int4.pack(planes(n, k, 2, seed=m, exact=False), n, k)
    x = fp32_rows(m, k, seed=m)
    cast = cpu_int4.mm(x.bfloat16(), packed, n)
    got = cpu_int4.mm(x, packed, n)
    assert torch.equal(got.isnan(), cast.isnan()) and torch.equal(got.nan_to_num(), cast.nan_to_num())
    r = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cpu_int4.mm(x, packed, n, residual=r).nan_to_num(), (cast + r).nan_to_num())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("cc"), reason="x86 cc")
@pytest.mark.parametrize("isa", ["-mno-avx512f", "-mno-avx2"], ids=["avx2", "plain-c"])
def test_the_other_builds_equal_the_oracle_too(tmp_path, monkeypatch, isa):
    """Built without AVX-512 (what an AVX2 laptop compiles: vpmaddubsw pairs, the int8 form
    through the sign trick) and without AVX2 (integer sums in plain C), the same layout gives the
    same quantization, the same exact results and row-independent bits -- and, on any rows, the
    same bits as this machine's own build: the integer sums are exact and the fp32 steps the same
    operations in the same order, so a model answers alike on every x86 CPU."""
    if isa == "-mno-avx512f" and "avx2" not in cbuild._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    gen = torch.Generator().manual_seed(9)
    rows = (torch.randn(13, 576, generator=gen) * 3).to(torch.bfloat16)
    forms = [cpu_int4.pack(planes(100, 576, 1, seed=9, exact=False), 100, 576)]
    forms.append(cpu_int4.pack_q8(*q8_matrix(100, 576, seed=9, exact=False), 100, 576))
    native = [cpu_int4.mm(rows, f, 100) for f in forms]  # the machine's own build
    # every block size (1-10 rows: the AVX2 build walks them in passes of their own)
    native_m = [[cpu_int4.mm(rows[:m], f, 100) for f in forms] for m in range(1, 11)]
    so = tmp_path / f"cpu_int4{isa}.so"
    flags = [*cbuild.FLAGS, *cbuild.OPENMP, isa]
    subprocess.run(["cc", *flags, str(cpu_int4.SOURCE), "-o", str(so)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    cpu_int4._setup(lib)
    monkeypatch.setattr(cpu_int4.KERNEL, "lib", lib)
    pl = planes(17, 96, 2, seed=4, exact=True)
    x = exact_rows(11, 96, seed=0)
    packed = cpu_int4.pack(pl, 17, 96)
    got = cpu_int4.mm(x, packed, 17)
    assert torch.equal(got.double(), oracle(x, pl))
    y = torch.randn(11, 96).to(torch.bfloat16)
    assert torch.equal(cpu_int4.mm(y[4:5], packed, 17)[0], cpu_int4.mm(y, packed, 17)[4])
    for f, want in zip(forms, native, strict=True):
        assert torch.equal(cpu_int4.mm(rows, f, 100), want)
    for m, wants in enumerate(native_m, 1):
        for f, want in zip(forms, wants, strict=True):
            assert torch.equal(cpu_int4.mm(rows[:m], f, 100), want), m
    eye = cpu_int4.pack([(torch.eye(96, dtype=torch.uint8), torch.ones(96, 3), torch.zeros(96, 3))], 96, 96)
    assert torch.equal(cpu_int4.mm(y, eye, 96).double(), dequantized(y))
    q, d = q8_matrix(17, 96, seed=5, exact=True)
    w = q.float() * d.repeat_interleave(32, 1)
    assert torch.equal(cpu_int4.mm(x, cpu_int4.pack_q8(q, d, 17, 96), 17).double(), x.double() @ w.double().T)


def q8_matrix(n: int, k: int, seed: int, exact: bool):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int16, generator=gen).to(torch.int8)
    if exact:
        d = 2.0 ** torch.randint(-4, 1, (n, k // 32), generator=gen).float()
    else:
        d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    return q, d


@pytest.mark.parametrize(("n", "k"), [(40, 64), (17, 96), (200, 576)])
@pytest.mark.parametrize("m", [1, 8, 13])
def test_the_int8_form_equals_an_exact_oracle(n, k, m):
    """Q8_0's form: the layout round-trips and every output equals the exact oracle."""
    q, d = q8_matrix(n, k, seed=n + m, exact=True)
    packed = cpu_int4.pack_q8(q, d, n, k)
    assert packed.shape == (-(-n // 16), k // 32, 1, cpu_int4.Q8_BYTES)
    w = q.float() * d.repeat_interleave(32, 1)
    assert torch.equal(cpu_int4.values(packed, n), w)
    x = exact_rows(m, k, seed=m)
    assert torch.equal(cpu_int4.mm(x, packed, n).double(), x.double() @ w.double().T)


def test_the_int8_forms_rows_do_not_depend_on_their_company():
    q, d = q8_matrix(49, 576, seed=2, exact=False)
    packed = cpu_int4.pack_q8(q, d, 49, 576)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    together = cpu_int4.mm(x, packed, 49)
    for r in (0, 8, 18):
        assert torch.equal(cpu_int4.mm(x[r : r + 1], packed, 49)[0], together[r])


def test_weights_packed_for_c_keep_multiplying_after_it_is_switched_off():
    """``set_enabled(False)`` (the benches' A/B) decides how weights packed later are held; those
    packed before go on through the C kernel."""
    pl = planes(16, 64, 1, seed=1, exact=True)
    packed = cpu_int4.pack(pl, 16, 64)
    x = exact_rows(2, 64, seed=0)
    try:
        cpu_int4.set_enabled(False)
        assert cpu_int4.library() is None and cpu_int4.status() == "off (set_enabled)"
        assert torch.equal(cpu_int4.mm(x, packed, 16).double(), oracle(x, pl))
    finally:
        cpu_int4.set_enabled(True)
    assert cpu_int4.status() == "ok"
