"""``SparseLinear``: one linear layer whose weight is stored once, in the format the policy picked
(dense, TCA-BME or weight-only low-bit), dispatching every call by the number of tokens N to the
kernel predicted (or measured, with ``policy="autotune"``) to be fastest for that format."""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import build, cpu_kernels, tuning
from ..format import TCABME
from ..ops import lowbit_mm, spmm
from ..ops.linear_input import direct_call_ok
from ..ops.lowbit_mm import entry_args as lowbit_entry_args
from ..ops.lowbit_mm import fused_max_n
from ..ops.spmm import CPU_DIRECT_MAX_N
from ..ops.spmm import entry_args as spmm_entry_args
from ..quant import LowBitWeight
from ..quant.lowbit import nibble_records, records_from_format3, records_in_dtype
from ..timing import least_of_rounds
from ..versions import changed, version_or_none
from . import policy as P

FORMATS = ("dense", "tca-bme", "lowbit")
POLICIES = ("auto", "autotune", "dense", "sparse", "lowbit")
_FORMAT_CODE = {"dense": 0, "tca-bme": 1, "lowbit": 2}
_QUANT_BITS = {"w8": 8, "w4": 4, "w2": 2}
_KERNELS = {"dense": (P.DENSE,), "tca-bme": (P.SPMM, P.DECODE_DENSE), "lowbit": (P.LOWBIT,)}


# The buffers each format's kernels read, and among them the structure arrays: those that say
# where the values lie. The kernels trust the structure (a bitmap that disagrees with the
# offsets, or a perm that is not a permutation, would make them read out of bounds), so a
# structure the layer did not make or check itself is validated before the next launch.
_ARRAYS = {"dense": ("weight",), "tca-bme": ("bitmap", "values", "gtile_offset", "row_offset"),
           "lowbit": ("qweight", "scale_zero", "perm")}
_STRUCTURE = {"dense": (), "tca-bme": ("bitmap", "gtile_offset", "row_offset"), "lowbit": ("perm",)}


class _Held:
    """What a layer derives from its buffers and keeps between calls (walking the buffers and
    rebuilding the format object cost microseconds of host time a call, and eager decode is
    host-bound: docs/policy.md), with the buffers it was derived from: their identities, and
    the version counters and data pointers of the structure arrays, so a buffer replaced by
    assignment (also through ``_buffers``, as accelerate does, or through ``.data``) or a
    structure edited in place is seen. Writes into ``.data`` in place move neither, and are not."""

    __slots__ = ("device", "where", "dtype", "weight", "arrays", "versions", "launches")

    def __init__(self, arrays, versions, device=None, weight=None, dtype=None):
        self.arrays = arrays  # ((name, tensor or None), ...)
        self.versions = versions  # ((tensor, its _version, its data_ptr()), ...), the structure arrays
        self.device, self.where, self.weight, self.dtype = device, str(device), weight, dtype
        self.launches: Dict[int, Optional[_Launch]] = {}  # N -> the eager launch, None where the kernel has none

    def matches(self, buffers) -> bool:
        for name, t in self.arrays:
            if buffers.get(name) is not t:
                return False
        if self.versions and not torch.compiler.is_compiling():  # (a traced _version is data)
            for t, v, p in self.versions:
                # versions.changed, inline on this per-call path (v is None: an inference tensor);
                # t.data = other moves no version counter, hence the pointer
                if (v is not None and t._version != v) or t.data_ptr() != p:
                    return False
        return True


_KEEP_LAUNCH_MAX_N = 256  # SparseLinear keeps eager launches for token counts up to this


def _autocasts_to_another(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast is on for x's device with a dtype other than ``dtype`` (there nn.Linear
    would return autocast's). The forward asks only once torch._C._is_any_autocast_enabled() says
    some autocast is on: ~0.1 us a call on the CPU, where this costs ~0.6. On the H100 host an
    eager call measured -1.5 and +0.5 us against the previous class in two processes (least of 7
    rounds), within the host's noise (docs/session61-h100-2026-11-25.log section 5)."""
    kind = x.device.type
    return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) != dtype


class _Launch:
    """One token count's eager kernel call, kept between calls: the extension's entry point
    (``build.eager_module()``) and every argument after x and the bias, so a call with nothing for
    the dispatcher to do (``direct_call_ok``) costs one Python call into C++. Good while the
    split-K table is as it was (``tuning.generation``) and, for low-bit weights, the zeros are
    (their version counter: the integer-zeros flag was computed from them)."""

    __slots__ = ("fn", "args", "generation", "zeros", "zeros_version")

    def __init__(self, fn, args, zeros=None):
        self.fn, self.args, self.generation = fn, args, tuning.generation()
        self.zeros, self.zeros_version = zeros, None if zeros is None else version_or_none(zeros)

    def current(self) -> bool:
        return self.generation == tuning.generation() and (self.zeros is None or
                                                           not changed(self.zeros, self.zeros_version))


def _check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


class SparseLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as dense, TCA-BME or low-bit. Build it with
    :meth:`from_linear` or :meth:`from_weight`."""

    # (class defaults for layers pickled before these existed: derive on the first call, and
    # trust the pickled buffers)
    _held: Optional[_Held] = None
    _trusted: Optional[_Held] = None

    def __init__(self, weight: Union[torch.Tensor, TCABME, LowBitWeight], bias: Optional[torch.Tensor] = None,
                 *, policy: str = "auto"):
        super().__init__()
        self.policy = _check_policy(policy)
        if isinstance(weight, TCABME):
            self.format = "tca-bme"
            self.out_features, self.in_features = weight.shape
            self.register_buffer("bitmap", weight.bitmap)
            self.register_buffer("values", weight.values)
            self.register_buffer("gtile_offset", weight.gtile_offset)
            # Derived from the bitmap, not saved: kept so a rebuilt weight object (under
            # torch.compile too) does not recompute it; _load_from_state_dict remakes it.
            self.register_buffer("row_offset", weight.row_offset, persistent=False)
            self._aux = (*weight.group_tile, weight.max_run, weight.nnz)
        elif isinstance(weight, LowBitWeight):
            self.format = "lowbit"
            self.out_features, self.in_features = weight.shape
            self.register_buffer("qweight", weight.qweight)
            self.register_buffer("scale_zero", weight.scale_zero)
            self.register_buffer("perm", weight.perm)
            self._aux = (weight.bits, weight.group_size, 0, 0)
        elif isinstance(weight, torch.Tensor):
            if weight.dim() != 2:
                raise ValueError(f"weight must be 2-D [out_features, in_features], got {tuple(weight.shape)}")
            self.format = "dense"
            self.out_features, self.in_features = weight.shape
            self.register_buffer("weight", weight.detach())
            self._aux = (0, 0, 0, 0)
        else:
            raise TypeError(f"weight must be a Tensor, TCABME or LowBitWeight, got {type(weight).__name__}")
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or bias.shape != (self.out_features,):
                raise ValueError(f"bias must be a tensor of shape ({self.out_features},)")
            bias = bias.detach()
        self.register_buffer("bias", bias)
        self._trusted = self._snapshot()  # buffers the layer made or checked itself
        # Derived now, not on the first call: a graph torch.compile traces before the first eager
        # call would otherwise guard on `_held is None`, and recompile after that call.
        self._derive()
        self._measured: Dict[tuple, Dict[str, float]] = {}  # autotune: (device, bucket) -> times
        self._choices: Dict[tuple, str] = {}  # (device, bucket) -> kernel, decided once

    # construction -------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, *, quant: Optional[str] = None, group_size: Optional[int] = 128,
                    policy: str = "auto") -> "SparseLinear":
        """Wrap an (already pruned) ``nn.Linear``; zeros in its weight become sparsity."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")
        return cls.from_weight(linear.weight.detach(), linear.bias, quant=quant, group_size=group_size,
                               policy=policy)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, quant: Optional[str] = None,
                    group_size: Optional[int] = 128, policy: str = "auto") -> "SparseLinear":
        """Store ``weight`` once in the format the policy picks: ``"dense"``/``"sparse"``/
        ``"lowbit"`` force one; ``"auto"``/``"autotune"`` pick by predicted decode-time (N=1)
        cost among the lossless formats, and the low-bit one when ``quant`` is given."""
        _check_policy(policy)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("weight must be a 2-D tensor [out_features, in_features]")
        if weight.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"weight must be float16 or bfloat16, got {weight.dtype}; call .half() or .bfloat16()")
        if quant is not None and quant not in _QUANT_BITS:
            raise ValueError(f"quant must be one of {sorted(_QUANT_BITS)} or None, got {quant!r}")
        if policy == "lowbit" and quant is None:
            raise ValueError("policy='lowbit' needs quant='w8', 'w4' or 'w2'")
        m, k = weight.shape
        if policy == "dense":
            return cls(weight, bias, policy=policy)
        if policy == "lowbit":
            return cls(LowBitWeight.quantize(weight, _QUANT_BITS[quant], group_size), bias, policy=policy)
        enc = TCABME.from_dense(weight)
        if policy == "sparse":
            return cls(enc, bias, policy=policy)
        prof = P.profile_for(weight.device)
        options = {
            "dense": P.predict(P.DENSE, m, k, 1, 2 * m * k, prof),
            "tca-bme": P.predict(P.SPMM, m, k, 1, enc.storage_bytes().total, prof, enc.geometry.num_group_tiles,
                                 sparsity=enc.sparsity),
        }
        low = None
        if quant is not None:
            low = LowBitWeight.quantize(weight, _QUANT_BITS[quant], group_size)
            options["lowbit"] = P.predict(P.LOWBIT, m, k, 1, low.storage_bytes().total, prof, bits=low.bits)
        best = min(options, key=options.get)
        stored = {"dense": weight, "tca-bme": enc, "lowbit": low}[best]
        return cls(stored, bias, policy=policy)

    # the stored weight ----------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        if self.format != "dense":
            # .float(), .double() or .to(torch.float32) would leave values or scales the kernels
            # do not take, and .type(dtype) would cast the integer arrays too: refuse before any
            # buffer changes, as the conversion shows on empty tensors of the two kinds.
            device = self._device()
            probe = fn(torch.empty(0, dtype=self.weight_dtype, device=device))
            if isinstance(probe, torch.Tensor) and probe.dtype not in (torch.float16, torch.bfloat16):
                raise TypeError(f"a {self.format} SparseLinear keeps its weight in float16 or bfloat16, so it cannot "
                                f"become {probe.dtype}; use .half() or .bfloat16(), or leave this layer out")
            target = probe.dtype if isinstance(probe, torch.Tensor) else self.weight_dtype
            probe = fn(torch.empty(0, dtype=torch.int64, device=device))
            if isinstance(probe, torch.Tensor) and probe.dtype != torch.int64:
                raise TypeError(f"this conversion would cast a {self.format} SparseLinear's integer arrays to "
                                f"{probe.dtype}; use .half() or .bfloat16() to change its dtype")
            sz = self._buffers.get("scale_zero")
            if self.format == "lowbit" and target != sz.dtype and nibble_records(sz):
                # The 4-bit zeros are bits inside the records, which a cast would convert as numbers:
                # the records are rebuilt in the new dtype (scales cast, zeros unchanged), then moved.
                self._buffers["scale_zero"] = records_in_dtype(sz, self.out_features, self._aux[0], target)
        self._choices = {}
        out = super()._apply(fn, recurse)
        self._trusted = self._snapshot()
        self._derive()  # device or dtype changed: derive again, from the converted trusted arrays
        return out

    def __getstate__(self):
        # What the layer derived is a cache, and its kept launches hold the extension's entry
        # points, which do not pickle: torch.save(model) after a CUDA call failed. Unpickled, the
        # layer derives again. Arrays the layer trusts when pickled (it made or checked them, and
        # nothing changed them since) stay trusted: unpickling runs the pickle's code anyway, so
        # it is no boundary to check at, and checking cost a 14336x4096 layer's deepcopy 0.2 s
        # on the CPU. Arrays changed since their check keep the old snapshot, whose data pointers
        # the copies cannot match, so they are checked when unpickled, as before.
        state = super().__getstate__()
        trusted = self._trusted is None or self._trusted.matches(self._buffers)
        return {**state, "_held": None, "_trusted": None if trusted else state.get("_trusted")}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._derive()

    def weight_object(self):
        """The stored weight as a TCABME / LowBitWeight / dense tensor (on the module's device)."""
        return self._state().weight

    def _snapshot(self) -> _Held:
        buffers = self._buffers
        arrays = tuple((name, buffers.get(name)) for name in _ARRAYS[self.format])
        versions = tuple((t, version_or_none(t), t.data_ptr()) for t in (buffers.get(n) for n in _STRUCTURE[self.format])
                         if t is not None)
        return _Held(arrays, versions)

    def _state(self) -> _Held:
        held = self._held
        if held is not None and held.matches(self._buffers):
            return held
        return self._derive()

    def _derive(self) -> _Held:
        """Rebuild the format object from the buffers. Buffers the layer did not make or check
        itself (assigned, or a structure array edited in place) are validated first."""
        now = self._snapshot()
        for name, t in now.arrays:
            if not isinstance(t, torch.Tensor) and not (name == "perm" and t is None):
                raise TypeError(f"SparseLinear.{name} must be a tensor buffer, got {type(t).__name__}; "
                                f"assign one with layer.{name} = tensor")
        checked = self._trusted is None or self._trusted.matches(self._buffers)
        shape = (self.out_features, self.in_features)
        if self.format == "tca-bme":
            gt_h, gt_w, max_run, nnz = self._aux
            if checked:
                weight = TCABME(self.bitmap, self.values, self.gtile_offset, shape, (gt_h, gt_w), validate=False,
                                max_run=max_run, row_offset=self.row_offset)
                weight._nnz = nnz
            else:  # validated, and the row table remade from the bitmap
                weight = TCABME(self.bitmap, self.values, self.gtile_offset, shape, (gt_h, gt_w))
                self._buffers["row_offset"] = weight.row_offset
                self._aux = (gt_h, gt_w, weight.max_run, weight.nnz)
            dtype = weight.dtype
        elif self.format == "lowbit":
            bits, g = self._aux[:2]
            weight = LowBitWeight(self.qweight, None, None, bits, g, shape, self.perm, scale_zero=self.scale_zero,
                                  validate=not checked)
            dtype = weight.scale_zero.dtype
        else:
            weight = self.weight
            if weight.dim() != 2 or tuple(weight.shape) != shape or not weight.is_floating_point():
                raise ValueError(f"SparseLinear.weight must be a float tensor of shape {shape}, "
                                 f"got {weight.dtype} {tuple(weight.shape)}")
            dtype = weight.dtype
        if not checked:
            self._choices = {}  # the nonzeros may have changed, and with them the best kernel
        now = self._snapshot()  # (after a remade row table)
        self._trusted = now
        device = next(t for _, t in now.arrays if t is not None).device
        self._held = _Held(now.arrays, now.versions, device, weight, dtype)
        return self._held

    @property
    def weight_dtype(self) -> torch.dtype:
        return self._state().dtype

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name != "bias")

    def _counted_sparsity(self) -> float:
        """A TCA-BME layer's sparsity from the nonzeros its last _state() counted."""
        return 1.0 - self._aux[3] / (self.out_features * self.in_features)

    @property
    def sparsity(self) -> float:
        if self.format == "tca-bme":
            self._state()  # (counts the nonzeros of arrays assigned since the last call)
            return self._counted_sparsity()
        if self.format == "dense":
            w = self.weight  # +0.0 only, as TCA-BME, in whatever float dtype the layer was given
            return float(((w == 0) & ~torch.signbit(w)).float().mean())
        return 0.0

    @property
    def compression_ratio(self) -> float:
        return 2 * self.out_features * self.in_features / self.memory_bytes()

    # dispatch -------------------------------------------------------------------------
    def candidates(self):
        return _KERNELS[self.format]

    def predicted(self, n: int, device=None) -> Dict[str, float]:
        """Predicted seconds of each candidate kernel for ``n`` tokens."""
        prof = P.profile_for(device if device is not None else self._device())
        m, k = self.out_features, self.in_features
        w = self.weight_object()
        ngt = w.geometry.num_group_tiles if self.format == "tca-bme" else 0
        bits = w.bits if self.format == "lowbit" else 4
        sparsity = self.sparsity if self.format == "tca-bme" else 0.0
        return {kern: P.predict(kern, m, k, n, self.memory_bytes(), prof, ngt, bits, sparsity)
                for kern in self.candidates()}

    def _device(self) -> torch.device:
        return self._state().device

    def choose(self, n: int) -> str:
        """The kernel for a call with ``n`` tokens."""
        return self._choose(n, self._state())

    def _choose(self, n: int, held: _Held) -> str:
        kernels = self.candidates()
        if len(kernels) == 1:
            return kernels[0]
        if self.policy == "sparse":
            return P.SPMM
        device, where = held.device, held.where
        if device.type != "cuda" and self.policy != "autotune":
            # On the CPU, a few tokens multiply straight from the arrays (spinfer.spmm's compiled
            # kernel), more decode the weight and run F.linear (docs/format.md).
            if n <= CPU_DIRECT_MAX_N and cpu_kernels.library() is not None:
                return P.SPMM
            return P.DECODE_DENSE
        bucket = P.n_bucket(n)
        key = (where, bucket)
        choice = self._choices.get(key)
        if choice is not None:
            return choice
        # Timing (autotune) synchronises and the device profile may come from a file: neither may
        # happen while a CUDA graph is being captured or torch.compile is tracing. Then the
        # default constants decide, without caching, and the next eager call decides for good.
        tracing = torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        if tracing:
            prof = P.DeviceProfile()
            m, k = self.out_features, self.in_features
            w = held.weight
            ngt = w.geometry.num_group_tiles if self.format == "tca-bme" else 0
            sparsity = self._counted_sparsity() if self.format == "tca-bme" else 0.0  # held: counted
            times = {kern: P.predict(kern, m, k, bucket, self.memory_bytes(), prof, ngt, sparsity=sparsity)
                     for kern in kernels}
            return min(times, key=times.get)
        if self.policy == "autotune" and key not in self._measured:
            # measured once per (device, format, shape, nonzeros, bucket), kept across processes
            disk_key = P.autotune_key(device, self.format, self.out_features, self.in_features, self._aux[3], bucket)
            times = P.load_autotuned(disk_key)
            if times is None or set(times) != set(kernels):
                times = self._time_candidates(bucket)
                P.store_autotuned(disk_key, times)
            self._measured[key] = times
        times = self._measured.get(key) or self.predicted(bucket, device)
        self._choices[key] = min(times, key=times.get)
        return self._choices[key]

    def _time_candidates(self, n: int) -> Dict[str, float]:
        if self._device().type == "cuda":  # the kernels' split-K factor first, then the kernel
            w = self.weight_object()
            if P.SPMM in self.candidates():
                tuning.tune_spmm(w, [n], reps=10)
            if P.LOWBIT in self.candidates() and n <= fused_max_n(w.bits):
                tuning.tune_lowbit(w, [n], reps=10)
        x = torch.randn(n, self.in_features, device=self._device(), dtype=self.weight_dtype)
        w, bias = self.weight_object(), self._buffers["bias"]
        return least_of_rounds({kern: (lambda kern=kern: self._run(kern, x, w, bias)) for kern in self.candidates()},
                               x.device, reps=10, max_seconds=2)

    def _run(self, kernel: str, x: torch.Tensor, w, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if kernel == P.DENSE:
            return F.linear(x, w, bias)
        if kernel == P.SPMM:
            return spmm(x, w, bias)
        if kernel == P.DECODE_DENSE:
            return F.linear(x, w.to_dense(), bias)
        return lowbit_mm(x, w, bias)

    def _launch(self, n: int, held: _Held) -> Optional[_Launch]:
        """The eager launch for ``n`` tokens, or None where the chosen kernel is not one of the
        extension's entry points: F.linear (a dense layer, where keeping it measured no faster
        on the H100 host), decode + cuBLAS, low-bit above the fused kernel's N."""
        kernel, w = self._choose(n, held), held.weight
        if kernel == P.SPMM and w.group_tile == (64, 64):
            args = spmm_entry_args(w, tuning.spmm_splits(w, n, held.device))
            return _Launch(build.eager_module().spmm, args)
        if kernel == P.LOWBIT and 0 < n <= fused_max_n(w.bits):
            args = lowbit_entry_args(w, tuning.lowbit_splits(w, n, held.device))
            return _Launch(build.eager_module().lowbit_mm, args, w.scale_zero)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape [..., {self.in_features}], got {tuple(x.shape)}")
        held = self._state()
        if x.dtype != held.dtype or (torch._C._is_any_autocast_enabled() and _autocasts_to_another(x, held.dtype)):
            return self._autocast_forward(x, held)
        bias = self._buffers["bias"]
        if self.format == "dense":  # one candidate, F.linear: nothing to choose or keep
            return F.linear(x, held.weight, bias)
        n = x.numel() // self.in_features
        launches = held.launches
        # (None: this N's kernel has no eager entry point, or N is large enough that host time
        # does not count and a server's many prompt lengths should not each keep one, or dynamo is
        # tracing, which would guard its graph on the dict's contents)
        launch = (launches.get(n, False) if n <= _KEEP_LAUNCH_MAX_N and not torch.compiler.is_compiling()
                  else None)
        if launch is not None and direct_call_ok(x, bias):
            # Eager decode is host-bound at batch 1 (docs/policy.md): the kernel choice, split-K
            # factor and arguments of each N are kept, and the call goes straight to the kernel.
            if launch is False or not launch.current():
                if torch.cuda.is_current_stream_capturing():  # (the choice would not be cached)
                    launch = None
                else:
                    launch = launches[n] = self._launch(n, held)
            if launch is not None:
                return launch.fn(x, bias, *launch.args)
        # Every kernel's wrapper takes leading dimensions as F.linear does, so x goes as it is:
        # one flatten, in the wrapper.
        return self._run(self._choose(n, held), x, held.weight, bias)

    def _autocast_forward(self, x: torch.Tensor, held: _Held) -> torch.Tensor:
        """An x of another dtype than the layer's, which only autocast accepts, or autocast to
        another dtype than the layer's: there nn.Linear computes in autocast's dtype and returns it,
        so a model kept in float32 with fp16 or bf16 layers runs. A dense layer goes to F.linear,
        which autocast casts; a compressed one takes x in its own dtype (its weight stays as
        stored) and returns autocast's dtype, as nn.Linear would."""
        kind = x.device.type
        if not (x.is_floating_point() and torch.is_autocast_enabled(kind)):
            raise TypeError(f"x is {x.dtype} but the layer is {held.dtype}; cast the input or the layer")
        if self.format == "dense":
            return F.linear(x, held.weight, self._buffers["bias"])
        with torch.autocast(kind, enabled=False):  # (the decode + cuBLAS path calls F.linear)
            y = self.forward(x.to(held.dtype))
        return y.to(torch.get_autocast_dtype(kind))

    def policy_report(self, print_it: bool = True) -> str:
        """Per N bucket: the chosen kernel, each candidate's predicted time and, if measured
        (autotune), its measured time."""
        device = self._device()
        lines = [f"{self!r}", f"{'N':>5}  {'choice':<13} " + "  ".join(f"{k + ' (pred/meas us)':>28}" for k in self.candidates())]
        for b in P.N_BUCKETS:
            pred = self.predicted(b, device)
            meas = self._measured.get((str(device), b), {})
            cells = "  ".join(f"{pred[k] * 1e6:>12.1f} / " + (f"{meas[k] * 1e6:>9.1f}" if k in meas else f"{'-':>9}")
                              + " " * 4 for k in self.candidates())
            lines.append(f"{b:>5}  {self.choose(b):<13} {cells}")
        text = "\n".join(lines)
        if print_it:
            print(text)
        return text

    # persistence ----------------------------------------------------------------------
    def _meta(self) -> torch.Tensor:
        return torch.tensor([1, _FORMAT_CODE[self.format], self.out_features, self.in_features, *self._aux],
                            dtype=torch.int64)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "spinfer_meta"] = self._meta()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "spinfer_meta"
        meta = state_dict.get(key)
        if meta is None:
            raise ValueError(f"{prefix or 'SparseLinear'}: state_dict has no spinfer_meta; it was not saved by a SparseLinear")
        theirs, ours = meta.tolist(), self._meta().tolist()
        if theirs[:4] != ours[:4] or (self.format != "tca-bme" and theirs[4:6] != ours[4:6]):
            fmt = {v: k for k, v in _FORMAT_CODE.items()}
            raise ValueError(
                f"{prefix or 'SparseLinear'}: state_dict holds a {fmt.get(theirs[1], '?')} {theirs[2]}x{theirs[3]} weight "
                f"{tuple(theirs[4:6])}, this layer is {self.format} {ours[2]}x{ours[3]} {tuple(ours[4:6])}")
        if self.format == "lowbit":
            assign = bool(local_metadata.get("assign_to_params_buffers", False))
            state_dict = self._incoming_records(state_dict, prefix + "scale_zero", theirs[4], assign)
        # TCA-BME arrays change length with the nonzeros: take the incoming sizes. The values keep
        # the layer's dtype, as load_state_dict keeps any module's (the bias, whose shape does not
        # change, is cast by copy_ either way; taking the incoming dtype left the two apart).
        for name, buf in list(self._buffers.items()):
            incoming = state_dict.get(prefix + name)
            # (and a low-bit weight's records: zeros as 4-bit integers or in the dtype, lowbit.py)
            records = (self.format == "lowbit" and name == "scale_zero" and isinstance(incoming, torch.Tensor)
                       and incoming.dim() == 3 and buf is not None and incoming.shape[:2] == buf.shape[:2])
            if (buf is not None and incoming is not None and incoming.shape != buf.shape
                    and (self.format == "tca-bme" or records)):
                dtype = buf.dtype if buf.is_floating_point() else incoming.dtype
                self._buffers[name] = torch.empty(incoming.shape, dtype=dtype, device=buf.device)
        # A low-bit weight's column permutation (act order: GPTQ's g_idx) comes with the weight
        # too: a state that carries the weight sets whether the layer has one.
        if self.format == "lowbit" and prefix + "qweight" in state_dict:
            incoming = state_dict.get(prefix + "perm")
            if incoming is None:
                self._buffers["perm"] = None
            elif self._buffers.get("perm") is None:
                self._buffers["perm"] = torch.empty(incoming.shape, dtype=torch.int64, device=self.qweight.device)
        state = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self._aux = tuple(int(v) for v in theirs[4:8])
        self._choices = {}
        self._held = None
        if self.format == "tca-bme" and not error_msgs:
            # Untrusted arrays and metadata: TCABME validates the arrays, refuses a max_run that is
            # not their longest run (one below it would truncate runs on CUDA), and makes the row
            # table of the loaded bitmap.
            gt_h, gt_w, max_run, _ = self._aux
            loaded = TCABME(self.bitmap, self.values, self.gtile_offset, (self.out_features, self.in_features),
                            (gt_h, gt_w), max_run=max_run)
            self.row_offset = loaded.row_offset
            self._trusted = self._snapshot()
        # Otherwise the copies moved the arrays' version counters, so deriving checks them (a
        # loaded perm, say, must be a permutation): here, so a bad state fails its load rather
        # than the first call, and a model compiled after loading finds the layer derived.
        if not error_msgs:
            self._derive()

    def _incoming_records(self, state_dict, key: str, bits: int, assign: bool):
        """A low-bit state's ``scale_zero`` in the form this layer loads: format 3's tiles of
        (scale, zero) pairs (saved before format 4; qweight is the same) become records, and records
        of 4-bit zeros in another dtype are rebuilt in this layer's, because the cast that loading
        makes would convert their bits as numbers. (With ``assign`` the layer takes the incoming
        tensors, dtype and all, as it takes the bias: nothing is cast, so nothing is rebuilt.)
        Returns the dict, or a copy where that changed."""
        incoming, buf = state_dict.get(key), self._buffers.get("scale_zero")
        if not isinstance(incoming, torch.Tensor) or buf is None:
            return state_dict  # (missing: load_state_dict reports it)
        records = records_from_format3(incoming, self.out_features, bits) if incoming.dim() == 4 else incoming
        if (not assign and records.dim() == 3 and records.dtype != buf.dtype and nibble_records(records)
                and records.dtype in (torch.float16, torch.bfloat16) and records.shape[:2] == buf.shape[:2]):
            records = records_in_dtype(records, self.out_features, bits, buf.dtype)
        return state_dict if records is incoming else {**state_dict, key: records}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"sparsity={self.sparsity:.3f}, compression_ratio={self.compression_ratio:.2f}x, "
                f"memory={self.memory_bytes() / 2**20:.2f} MiB, policy={self.policy}")
