"""A CPU step's decoder layers in one C call (``cpu_decoder.c``): built at first use, called through ctypes.

Where every layer weight of a model is packed for the C matmul (``cpu_int4``) and every window of
a step attends in C (``cpu_native``), ``LlamaModel.forward`` hands the step's rows to ``Decoder.run``
instead of its per-layer loop: one call runs all layers (norms, the matmuls, RoPE, the K/V store,
attention, silu, the residual adds) in one OpenMP region, where the loop made ~60 torch ops and 5
ctypes calls a layer, each a dispatch that cost more than its arithmetic on a decode row, and
each parallel matmul its own fork and join. The embedding, the final norm, the LM head and
sampling stay in torch (once a step).

The bits are those of the torch loop: the C computes each pointwise op as torch's CPU kernel for
it does, which depends on torch's CPU capability (``_torch_kernels``); a capability whose
rounding is not modelled keeps the loop. ``tests/test_cpu_decoder.py`` compares the two.

``TURNKV_CPU_KERNEL=off``, a failed build, or a model the C does not cover (biases, q/k norms,
tensor parallelism, a non-fp32 model, a weight not packed for C) keep the loop; ``set_enabled``
switches it for A/B benches in one process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from turnkv import cbuild
from turnkv.attention import cpu_native
from turnkv.models import cpu_int4
from turnkv.models.quant import QuantWeight

SOURCE = Path(__file__).with_name("cpu_decoder.c")
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# Steps of up to this many rows give each thread its own activations to compute (the C's
# ``rows_of``): each thread then norms (or silus) and quantizes the rows itself, where splitting
# them over the threads cost a barrier more before each of the four matmuls of a layer.
OWN_ROWS = 2


class _Layer(ctypes.Structure):
    """The C's ``tkv_layer``."""

    _fields_ = [(n, _ptr) for n in ("attn_norm", "mlp_norm", "qkv", "o", "gate_up", "down")]


class _Model(ctypes.Structure):
    """The C's ``tkv_model``."""

    _fields_ = [(n, _ptr) for n in ("prepare", "part", "slice", "store", "exp8", "layer")]
    _fields_ += [(n, _i64) for n in ("layers", "hidden", "inter", "hq", "hkv", "d", "torch_fma", "torch_vec")]
    _fields_ += [("eps", _f32), ("scale", _f32)]


_STEP_PTRS = ("x", "x2", "cos", "sin", "pos", "qkv", "qk", "att", "gu", "h", "q", "qd", "qdq", "bf16")
_STEP_PTRS += ("wins", "views", "items", "cuts")


class _Step(ctypes.Structure):
    """The C's ``tkv_step``."""

    _fields_ = [("M", _i64), ("threads", _i64)] + [(n, _ptr) for n in _STEP_PTRS[:14]]
    _fields_ += [("kmax", _i64), ("sets", _i64), ("rope_rows", _i64)] + [(n, _ptr) for n in _STEP_PTRS[14:]]
    _fields_ += [(n, _i64) for n in ("nwins", "parts", "dtype", "scratch_stride")] + [("scratch", _ptr)]


def _setup(lib: ctypes.CDLL) -> None:
    lib.turnkv_decoder_layers.argtypes = [_ptr, _ptr]
    lib.turnkv_decoder_layers.restype = ctypes.c_int
    lib.turnkv_decoder_norm.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr]
    lib.turnkv_decoder_norm.restype = None
    lib.turnkv_decoder_can.argtypes = [_i64]
    lib.turnkv_decoder_can.restype = _i64


# no contraction: only the FMAs the C writes out are fused (torch's rounding, see the C file)
KERNEL = cbuild.Kernel(SOURCE, _setup, "torch ops", flags=("-ffp-contract=off",))
library = KERNEL.library
set_enabled = KERNEL.set_enabled  # steps from now on run the layers in C (True) or the torch loop
status = KERNEL.status


def _torch_kernels() -> tuple[int, int, int] | str:
    """``(fma, vec, exp8)`` of torch's CPU kernels, or why they are not modelled: whether they
    fuse ``a * b + c`` (its x86 builds with FMA), the floats of its silu loop's vector block,
    and the address of the SLEEF ``expf`` over 8 floats that it links (0 where it takes libm's)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "DEFAULT":
        return 0, 0, 0
    if cap not in ("AVX2", "AVX512"):
        return f"torch's CPU capability {cap}: its kernels' rounding is not modelled"
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        exp8 = ctypes.cast(lib.Sleef_expf8_u10avx2, _ptr).value
    except (OSError, AttributeError) as e:
        return f"torch's SLEEF expf not found ({e})"
    return 1, 32 if cap == "AVX512" else 16, int(exp8 or 0)


def _kernel_libs() -> tuple:
    """The matmul and attention libraries the C calls now (what ``cpu_int4.Matrix.mm`` and
    ``cpu_native.NativeStep`` call: a test may swap in another ISA's build)."""
    return cpu_int4.KERNEL.lib or cpu_int4.KERNEL.loaded, cpu_native.KERNEL.lib


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return int(ctypes.cast(getattr(lib, name), _ptr).value or 0)


class Decoder:
    """A model's layers bound for the C call (``bind``); ``run`` per step. Invariant: holds every
    tensor whose address the bound structs carry (the weights, via ``weights``)."""

    def __init__(self, model, lib: ctypes.CDLL, kernels: tuple[int, int, int]):
        cfg = model.cfg
        self.weights = [layer.weights() for layer in model.layers]  # what the structs point into
        self._layers = (_Layer * len(self.weights))()
        self._mats = []
        for slot, (attn_norm, qkv, _, _, _, o, _, mlp_norm, gate_up, down) in zip(
            self._layers, self.weights, strict=True
        ):
            mats = [w._c_matrix() for w in (qkv, o, gate_up, down)]
            self._mats.append(mats)
            slot.attn_norm, slot.mlp_norm = attn_norm.data_ptr(), mlp_norm.data_ptr()
            slot.qkv, slot.o, slot.gate_up, slot.down = (ctypes.addressof(m._args) for m in mats)
        q4, att = _kernel_libs()
        fma, vec, exp8 = kernels
        self._model = _Model(
            _fn(q4, "turnkv_q4_prepare"), _fn(q4, "turnkv_q4_part"), _fn(att, "turnkv_attend_slice"),
            _fn(att, "turnkv_store"), exp8, ctypes.addressof(self._layers),
            len(self.weights), cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, fma, vec, cfg.rms_norm_eps, model.scale,
        )  # fmt: skip
        self._fn, self._norm = lib.turnkv_decoder_layers, lib.turnkv_decoder_norm
        self._mptr = ctypes.addressof(self._model)
        self._step = _Step()
        self._sptr = ctypes.addressof(self._step)
        self._bufs: tuple[tuple[int, int], list[torch.Tensor]] = ((0, 0), [])
        c = cfg
        self._kmax = max(c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim)
        self._widths = (
            c.hidden_size,  # x2
            (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,  # qkv
            (c.num_heads + c.num_kv_heads) * c.head_dim,  # qk
            c.num_heads * c.head_dim,  # att
            2 * c.intermediate_size,  # gu
        )

    @staticmethod
    def bind(model) -> Decoder | str:
        """The decoder of ``model`` (a ``LlamaModel``), or why the C does not cover it."""
        cfg = model.cfg
        if model.device.type != "cpu" or model.dtype != torch.float32 or model.tp is not None:
            return "not a one-process fp32 CPU model"
        lib = library()
        if lib is None or cpu_int4.KERNEL.loaded is None or cpu_native.library() is None:
            return (
                f"a C kernel is off ({status()}; matmul {cpu_int4.status()}; attention {cpu_native.status()})"
            )
        kernels = _torch_kernels()
        if isinstance(kernels, str):
            return kernels
        if not lib.turnkv_decoder_can(kernels[1]):
            return "this build cannot call torch's SLEEF expf (no AVX)"
        if cfg.hidden_size % 32 or cfg.intermediate_size % 32 or cfg.head_dim % 2:
            return f"sizes {cfg.hidden_size}/{cfg.intermediate_size}/{cfg.head_dim} not covered"
        for layer in model.layers:
            attn_norm, qkv, qkv_b, q_norm, _, o, o_b, mlp_norm, gate_up, down = layer.weights()
            if qkv_b is not None or o_b is not None or q_norm is not None:
                return "biases or q/k norms: not covered"
            for w in (qkv, o, gate_up, down):
                if not (isinstance(w, QuantWeight) and w.native):
                    return "a layer weight not packed for the C matmul"
            for n in (attn_norm, mlp_norm):
                if n.dtype != torch.float32 or not n.is_contiguous():
                    return "norm weights not contiguous fp32"
        return Decoder(model, lib, kernels)

    def _buffers(self, m: int, threads: int) -> tuple[int, list[torch.Tensor]]:
        """The step's buffers for ``m`` rows (the C's ``tkv_step``) and their sets' count."""
        sets = threads if m <= OWN_ROWS else 1
        kept_m, kept_sets = self._bufs[0]
        if kept_m == m and kept_sets >= sets:  # (the thread governor may switch counts between steps)
            sets = kept_sets if m <= OWN_ROWS else sets
        if self._bufs[0] != (m, sets):  # (a decode step's rows repeat: kept for the next step)
            k = self._kmax * m * sets
            shared = [torch.empty(m, w) for w in self._widths]
            per_set = [
                torch.empty(k),
                torch.empty(k, dtype=torch.int8),
                torch.empty(k // 32),
                torch.empty(k // 32),
            ]
            self._bufs = ((m, sets), [*shared, *per_set, torch.empty(k, dtype=torch.int16)])
        return sets, self._bufs[1]

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        native: cpu_native.NativeStep,
    ) -> torch.Tensor:
        """Every layer over the step's rows ``x`` fp32 ``[N, hidden]`` at ``positions`` int64 ``[N]``
        (covered by the RoPE tables ``rope``: cos, signed sin ``[P, D]`` fp32 contiguous, as
        ``llama.Rope.tables``), attending through ``native`` (all the step's windows) -> the
        residual stream after the last layer ``[N, hidden]`` (x itself, rewritten)."""
        x = x if x.is_contiguous() else x.contiguous()
        positions = positions if positions.is_contiguous() else positions.contiguous()
        m, threads = x.shape[0], torch.get_num_threads()
        sets, (x2, qkv, qk, att, gu, h, q, qd, qdq, bf16) = self._buffers(m, threads)
        wins, views, items, cuts, nwins, parts, dtype, scratch, stride = native.tables(self._model.hq)
        s = self._step
        s.M, s.threads, s.kmax, s.sets, s.rope_rows = m, threads, self._kmax, sets, rope[0].shape[0]
        s.x, s.x2, s.cos, s.sin, s.pos = (
            x.data_ptr(),
            x2.data_ptr(),
            rope[0].data_ptr(),
            rope[1].data_ptr(),
            positions.data_ptr(),
        )
        s.qkv, s.qk, s.att, s.gu, s.h = (
            qkv.data_ptr(),
            qk.data_ptr(),
            att.data_ptr(),
            gu.data_ptr(),
            h.data_ptr(),
        )
        s.q, s.qd, s.qdq, s.bf16 = q.data_ptr(), qd.data_ptr(), qdq.data_ptr(), bf16.data_ptr()
        s.wins, s.views, s.items, s.cuts = wins, views, items, cuts
        s.nwins, s.parts, s.dtype, s.scratch_stride, s.scratch = nwins, parts, dtype, stride, scratch
        rc = self._fn(self._mptr, self._sptr)
        if rc == 2:
            raise ValueError(
                f"a position past the RoPE tables' {rope[0].shape[0]} rows (call rope.ensure first)"
            )
        if rc:
            raise RuntimeError(f"turnkv_decoder_layers failed ({rc})")
        return x

    def final_norm(self, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of rows ``rows`` int64 ``[R]`` of ``run``'s ``x`` -> fp32 ``[R, hidden]``
        (the torch path's norm before its bf16 cast, which the LM head's C matmul makes)."""
        rows = rows if rows.is_contiguous() else rows.contiguous()
        y = torch.empty(rows.shape[0], x.shape[1])
        self._norm(self._mptr, rows.shape[0], x.data_ptr(), rows.data_ptr(), weight.data_ptr(), y.data_ptr())
        return y


class _Binding(NamedTuple):
    """What a model was bound to: its decoder or why none, and what that was decided for."""

    decoder: Decoder | None
    why: str
    weights: list  # each layer's ``weights()`` tuple then
    libs: tuple  # ``_kernel_libs()`` then


def for_model(model) -> Decoder | None:
    """``model``'s decoder (``Decoder.bind``), bound at its first step and again when a layer's
    weights changed (setting a layer's attribute drops its ``weights()`` tuple) or a kernel's
    library did; None where the C is off or does not cover the model (``why``)."""
    if model.device.type != "cpu" or library() is None:
        return None
    got = model.__dict__.get("_cpu_decoder")
    if got is None or not _current(got, model):
        bound = Decoder.bind(model)
        weights = [layer.weights() for layer in model.layers]
        dec = bound if isinstance(bound, Decoder) else None
        got = model.__dict__["_cpu_decoder"] = _Binding(
            dec, "ok" if dec else str(bound), weights, _kernel_libs()
        )
    return got.decoder


def why(model) -> str:
    """Why ``model``'s steps run the torch loop (``ok``: they run in C)."""
    if model.device.type != "cpu" or library() is None:
        return f"off ({status()})" if model.device.type == "cpu" else "not a CPU model"
    for_model(model)
    return model.__dict__["_cpu_decoder"].why


def _current(b: _Binding, model) -> bool:
    libs = _kernel_libs()
    if libs[0] is not b.libs[0] or libs[1] is not b.libs[1]:
        return False
    return all(layer.__dict__.get("_weights") is w for layer, w in zip(model.layers, b.weights, strict=True))
