"""The fused native steps of Llama-family models (kernels/cpu/llama_step.c).

:class:`FusedLlamaForward` packs a loaded model's weight pointers (and the blocked GEMM's packed
copies of its four projection weights) and a KV backend's per-layer cache pointers into the C
structs once per KV backend (engines sharing the model, e.g. a prefill/decode pair in one process,
each get their own binding and workspace and may step at the same time), then runs a whole step
(every layer) in one native call:

- a pure decode step of up to 8 rows (``__call__``, the decode kernel: weights streamed once for
  all rows), speculative verify chunks included (a chunk's rows: one slot, consecutive positions);
- any step of up to ``max_step_tokens`` tokens mixing decode rows and prefill chunks (``step``, the
  general kernel: blocked GEMMs, varlen attention over every chunk in one call, KV rows stored in
  place).

Quantized projections (:class:`~xllm.models.layers.QuantLinear`, any format of
:mod:`xllm.kernels.quant`) go into the layer struct as a format tag and pointers (``XllmQWeight``):
the kernels run the quantized GEMV (<= 8 rows; 9-16 over chunks of 8) or the panel-dequantizing GEMM of
``kernels/cpu/gemm_quant.h`` for them, float ones as before.

KV rows are the backend's model-dtype rows or its quantized rows (``--kv-cache-dtype int8|fp8_e4m3``:
the kernels encode each new K/V head as the eager store does and attend over the codes with the eager
path's quantized attention kernels, :mod:`xllm.kernels.kv_quant`).

A tensor-parallel shard (``model.tp`` with ``size > 1``) keeps the fused path when its communicator is a
:class:`~xllm.core.parallel.shm.ShmComm`: the config struct carries the group's native handle and both
kernels all-reduce the O and down projections' partial sums inside their OpenMP team (the embedding's
all-reduce and the final norm stay in Python, as in one process); a failed collective raises
:class:`~xllm.core.parallel.comm.CollectiveError` naming the ranks that did not arrive. Other
communicators (gloo) take the eager path.

Multi-LoRA: once the model's adapter slots exist (:meth:`FusedLlamaForward.attach_lora`, from
``LlamaForCausalLM.lora_stack``), a step whose rows use adapters (``LoraStack.rows`` on this thread) passes the
kernels its rows' slots and the slots' scales, and they add each row's adapter product after every adapted
projection (kernels/cpu/lora_step.h; gate/up then runs unfused, the adapter before SiLU-and-mul).

It applies only where the C kernel's layout assumptions hold; :meth:`model_supported` says so and
the caller falls back to the eager module path otherwise. It is the
:class:`xllm.core.model_api.FusedForward` of Llama-family models.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass, field

import torch

from xllm.core.model_api import SlotKV, StepTokens
from xllm.core.parallel.shm import ShmComm
from xllm.kernels import native, quant_native, rms_norm
from xllm.kernels.linear import MAX_NATIVE_ROWS
from xllm.kernels.quant import QuantizedWeight
from xllm.models.lora import LoraStack


def _projections(layer) -> tuple:
    """A decoder layer's four projections in the kernel's order: qkv, o, gate_up, down."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


@dataclass
class _Binding:
    """The kernel's view of one KV backend: its config and layer structs, and the workspace of its
    steps (one engine steps its backend one step at a time, so a workspace per backend is race-free)."""

    cfg: object  # native.LlamaCfg
    layers: object  # ctypes array of native.LlamaLayer
    work: torch.Tensor | None = None
    keep: list = field(default_factory=list)  # tensors the structs point at that nothing else holds

    def workspace(self, elems: int, dtype: torch.dtype) -> torch.Tensor:
        if self.work is None or self.work.numel() < elems or self.work.dtype != dtype:
            self.work = torch.empty(elems, dtype=dtype)
        return self.work


@dataclass
class _LoraBinding:
    """The model's adapter slots as the kernels read them: per layer the four projections' stacked A/B
    (``layers``, pointing into ``stack``'s tensors) and the widest projection's ``n`` (the scratch per row)."""

    stack: LoraStack
    layers: object  # ctypes array of native.LoraLayer
    n_max: int


class FusedLlamaForward:
    """Whole steps of a :class:`~xllm.models.llama.LlamaForCausalLM` through one native call each."""

    max_batch = MAX_NATIVE_ROWS  # the decode kernel's GEMMs stream each weight once for up to this many rows

    PHASES = ("norm", "qkv GEMM", "rope + KV store", "attention", "o GEMM", "norm", "gate/up GEMM + SiLU",
              "down GEMM")  # the general step's parts, in kernel order (llama_forward.h)

    def __init__(self, model, max_step_tokens: int = 8192) -> None:
        self.model = model
        self.max_step_tokens = max_step_tokens
        # set to zeros(len(PHASES), float64) to profile steps: both kernels add each phase's wall time (the decode
        # kernel counts q/k norm, RoPE and the KV store as attention)
        self.phase_seconds: torch.Tensor | None = None
        # one binding per KV backend: engines sharing this model (PD pairs in one process) step
        # concurrently, each over its own cache and workspace
        self._bindings: weakref.WeakKeyDictionary[SlotKV, _Binding] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # guards _bindings and _packed (built on first use)
        self._packed: list | None = None  # keeps the packed weights alive while the structs point at them
        self._lora: _LoraBinding | None = None  # the model's adapter slots as the kernels read them (attach_lora)
        # cos/sin tables must stay float32 and contiguous for the kernel
        self._cos = model.rotary.cos.contiguous()
        self._sin = model.rotary.sin.contiguous()

    @staticmethod
    def model_supported(model) -> bool:
        from xllm.models.layers import QuantLinear
        from xllm.models.llama import LlamaMLP

        cfg = model.cfg
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1 and not isinstance(tp.comm, ShmComm):
            return False  # the kernels all-reduce through the shared-memory group only (gloo: the eager path)
        if not all(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers):
            return False  # MoE or other MLPs: the kernel implements the dense SwiGLU block only
        quantized = [lin for layer in model.model.layers for lin in _projections(layer) if isinstance(lin, QuantLinear)]
        if quantized and (quant_native.library() is None
                          or any(lin.qweight.fmt not in quant_native.QUANT_TAGS for lin in quantized)):
            return False  # the quantized kernels need AVX512-VNNI (the eager path runs the torch fallback)
        attn = model.model.layers[0].self_attn
        mult = 32 if model.dtype == torch.bfloat16 else 16
        return (
            native.library() is not None
            and model.dtype in (torch.bfloat16, torch.float32)
            and cfg.hidden_size % mult == 0
            and (attn.num_heads * attn.head_dim) % mult == 0
            and int(cfg.raw["intermediate_size"]) % mult == 0
            and attn.head_dim <= 512
            and attn.o_proj.bias is None
            and model.rotary.cos.shape[-1] == attn.head_dim
        )

    def supports(self, kv: SlotKV) -> bool:
        """Model-dtype KV, or quantized rows whose head width the quantized attention kernels take (a
        multiple of 16)."""
        kind = kv.kv_quant_kind
        head_dim = self.model.model.layers[0].self_attn.head_dim
        return kind is None or (kind in native.KV_QUANT_TAGS and head_dim % 16 == 0)

    def _packed_weights(self) -> list:
        """Per layer, for (qkv, o, gate_up, down): the blocked GEMM's packed weight, a quantized
        projection's kernel-ready :class:`~xllm.kernels.quant.QuantizedWeight`, or None."""
        from xllm.models.layers import QuantLinear

        if self._packed is None:
            self._packed = [[quant_native.kernel_ready(lin.qweight) if isinstance(lin, QuantLinear)
                             else lin.native_packed() for lin in _projections(layer)]
                            for layer in self.model.model.layers]
        return self._packed

    def _bind(self, kv: SlotKV) -> _Binding:
        """The C structs for ``kv``'s tensors, built on its first step (a backend's tensors never move).
        Safe to call from the threads of several engines at once."""
        binding = self._bindings.get(kv)
        if binding is not None:
            return binding
        with self._lock:
            binding = self._bindings.get(kv)
            if binding is None:
                binding = self._bindings[kv] = self._build_binding(kv)
        return binding

    def _build_binding(self, kv: SlotKV) -> _Binding:
        m = self.model
        layers = m.model.layers
        kvs = [kv.layer_kv(i) for i in range(len(layers))]
        attn0 = layers[0].self_attn
        k0, v0 = kvs[0]
        kind = kv.kv_quant_kind
        for k, v in kvs:
            if v is None or k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != k0.stride():
                raise ValueError("fused steps need per-slot K and V rows of one layout in every layer")
            if kind is None and (k.dim() != 4 or k.stride(2) != attn0.head_dim or v.stride(2) != attn0.head_dim):
                raise ValueError("fused steps need [slots, max_len, kv_heads, head_dim] KV tensors, each token's "
                                 "KV heads packed in one row")
            if kind is not None and (k.dim() != 3 or k.dtype != torch.uint8
                                     or min(k.shape[-1], v.shape[-1]) < attn0.num_kv_heads * (attn0.head_dim + 4)):
                raise ValueError("fused steps over a quantized KV cache need uint8 [slots, max_len, row_bytes] rows "
                                 "of kv_heads x (head_dim codes + fp32 scale)")
        cfg = native.LlamaCfg(
            hidden=m.cfg.hidden_size, n_heads=attn0.num_heads, n_kv_heads=attn0.num_kv_heads,
            head_dim=attn0.head_dim, inter=int(m.cfg.raw["intermediate_size"]), n_layers=len(layers),
            k_slot_stride=k0.stride(0), k_tok_stride=k0.stride(1), v_slot_stride=v0.stride(0),
            v_tok_stride=v0.stride(1), eps=float(layers[0].input_layernorm.eps), scale=float(attn0.scale),
            qk_norm=int(attn0.q_norm is not None), rotary_dim=m.rotary.cos.shape[-1],
            kv_quant=native.KV_QUANT_TAGS[kind], comm=self._comm_handle())
        packed = self._packed_weights()
        arr = (native.LlamaLayer * len(layers))()

        def ptr(t):
            return None if t is None else t.data_ptr()

        keep = []  # biases cast to the activations' dtype: alive as long as the structs

        def bias_ptr(lin):
            if lin.bias is None:
                return None
            b = lin.bias.detach().to(m.dtype).contiguous()
            keep.append(b)
            return b.data_ptr()

        for i, layer in enumerate(layers):
            a = layer.self_attn
            lins = _projections(layer)
            plain = [None if isinstance(pw, QuantizedWeight) else pw for pw in packed[i]]
            quant = [quant_native.struct(pw) if isinstance(pw, QuantizedWeight) else native.QWeight()
                     for pw in packed[i]]
            qkv_p, o_p, gu_p, down_p = (None if pw is None else pw.data for pw in plain)
            qkv_w, o_w, gu_w, down_w = (None if isinstance(pw, QuantizedWeight) else ptr(lin.weight)
                                        for lin, pw in zip(lins, packed[i], strict=True))
            arr[i] = native.LlamaLayer(
                ln1=ptr(layer.input_layernorm.weight), qkv_w=qkv_w, qkv_b=bias_ptr(a.qkv_proj),
                q_norm=ptr(a.q_norm.weight) if a.q_norm is not None else None,
                k_norm=ptr(a.k_norm.weight) if a.k_norm is not None else None,
                o_w=o_w, o_b=bias_ptr(a.o_proj), ln2=ptr(layer.post_attention_layernorm.weight),
                gate_up_w=gu_w, down_w=down_w,
                k_cache=kvs[i][0].data_ptr(), v_cache=kvs[i][1].data_ptr(), qkv_wp=ptr(qkv_p), o_wp=ptr(o_p),
                gate_up_wp=ptr(gu_p), down_wp=ptr(down_p), qkv_q=quant[0], o_q=quant[1], gate_up_q=quant[2],
                down_q=quant[3])
        return _Binding(cfg, arr, keep=keep)

    @property
    def serves_lora(self) -> bool:
        """Whether steps with LoRA adapter rows may run fused (the model's adapter slots are attached)."""
        return self._lora is not None

    def attach_lora(self, stack: LoraStack) -> None:
        """Serve the adapters of ``stack`` (the model's slots; their tensors never move) in the fused steps."""
        arr = (native.LoraLayer * len(self.model.model.layers))()
        for i, layer in enumerate(self.model.model.layers):
            for field_name, lin in zip(("qkv", "o", "gate_up", "down"), _projections(layer), strict=True):
                proj = lin.lora
                if proj is None:
                    continue
                layout = proj.layout
                setattr(arr[i], field_name, native.LoraProj(
                    a=proj.a.data_ptr(), b=proj.b.data_ptr(), n=proj.a.shape[1], rank=proj.rank,
                    n_parts=layout.n_parts, part_start=(ctypes.c_int64 * 3)(*layout.starts),
                    part_size=(ctypes.c_int64 * 3)(*layout.sizes)))
        n_max = max((p.a.shape[1] for p in stack.projections.values()), default=0)
        self._lora = _LoraBinding(stack, arr, n_max)

    def _lora_step(self, rows: int) -> tuple[native.LoraStep, tuple] | tuple[None, tuple]:
        """The kernels' view of this thread's adapter rows for a step of ``rows`` rows (None: the base model's)."""
        bound = self._lora
        current = None if bound is None else bound.stack.current_rows()
        if current is None:
            return None, ()
        if current.slots.numel() != rows:
            raise ValueError(f"the step has {rows} rows but its LoRA slots name {current.slots.numel()}")
        tmp = torch.empty(rows * bound.n_max, dtype=torch.float32)
        groups = native.LoraGroups(order=current.order.data_ptr(), gslot=current.gslot.data_ptr(),
                                   gstart=current.gstart.data_ptr(), groups=len(current.groups))
        step = native.LoraStep(layers=bound.layers, groups=groups, scale=current.scales.data_ptr(),
                               tmp=tmp.data_ptr())
        return step, (current, tmp)

    def _comm_handle(self) -> int | None:
        """The shard's shared-memory group for the kernels' all-reduces (None: one process)."""
        tp = getattr(self.model, "tp", None)
        if tp is None or tp.size == 1:
            return None
        if not isinstance(tp.comm, ShmComm):
            raise ValueError("the fused steps of a tensor-parallel shard need a ShmComm communicator")
        return tp.comm.native_handle()

    def _kernel(self, name: str, dtype: torch.dtype):
        lib = native.library().lib
        return getattr(lib, f"xllm_llama_{name}_{'bf16' if dtype == torch.bfloat16 else 'f32'}")

    def _check(self, rc: int, what: str) -> None:
        """Raise CollectiveError for a kernel's failed all-reduce (XSHM_* code ``rc``)."""
        if rc != 0:
            raise self.model.tp.comm.error_for(rc, f"the fused {what} step's all_reduce")

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 kv: SlotKV) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` of ``B`` <= 8 rows: one decode token per sequence, or
        a speculative verify chunk as consecutive rows of one slot at consecutive positions.

        ``positions[b]`` is the position of row ``b``'s token (its context then spans
        ``[0, positions[b]]`` in slot ``slots[b]``); its K/V are written by the kernel, a verify
        chunk's rows in order, so each attends over the rows before it.
        """
        m = self.model
        bound = self._bind(kv)
        b = input_ids.shape[0]
        if b > self.max_batch:
            raise ValueError(f"fused decode handles at most {self.max_batch} sequences")
        c = bound.cfg
        hidden = m.model.embed_tokens(input_ids).contiguous()
        residual = torch.empty_like(hidden)
        qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        per_row = c.hidden + qkv_dim + c.n_heads * c.head_dim + 3 * c.inter  # r_alt, qkv, attn, act, gate/up
        work = bound.workspace(self.max_batch * per_row, hidden.dtype)
        slots = slots.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        lora, _alive = self._lora_step(b)
        rc = self._kernel("decode", hidden.dtype)(
            ctypes.byref(c), bound.layers, b, slots.data_ptr(), positions.data_ptr(), self._cos.data_ptr(),
            self._sin.data_ptr(), hidden.data_ptr(), residual.data_ptr(), work.data_ptr(),
            None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
            None if lora is None else ctypes.byref(lora))
        self._check(rc, "decode")
        norm = m.model.norm
        out, _ = rms_norm(hidden, norm.weight, norm.eps, residual)
        return out

    @torch.inference_mode()
    def step(self, tokens: StepTokens, kv: SlotKV) -> torch.Tensor:
        """Final hidden states of ``tokens.sample_rows`` for a step of decode rows and prefill chunks
        (see :class:`~xllm.core.model_api.StepTokens`); every row's K/V is written by the kernel."""
        m = self.model
        bound = self._bind(kv)
        t = tokens.input_ids.shape[0]
        if t > self.max_step_tokens:
            raise ValueError(f"a fused step handles at most {self.max_step_tokens} tokens")
        c = bound.cfg
        hidden = m.model.embed_tokens(tokens.input_ids).contiguous()
        residual = torch.empty_like(hidden)
        qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        per_row = qkv_dim + c.n_heads * c.head_dim + 3 * c.inter + c.hidden  # qkv, attn, gate_up, act, x
        work = bound.workspace(t * per_row, hidden.dtype)
        ints = [x.to(torch.int64).contiguous() for x in (tokens.token_slots, tokens.positions, tokens.seq_starts,
                                                           tokens.context_lens, tokens.seq_slots)]
        token_slots, positions, starts, lens, seq_slots = ints
        lora, _alive = self._lora_step(t)
        rc = self._kernel("forward", hidden.dtype)(
            ctypes.byref(c), bound.layers, t, token_slots.data_ptr(), positions.data_ptr(), lens.numel(),
            starts.data_ptr(), lens.data_ptr(), seq_slots.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(),
            hidden.data_ptr(), residual.data_ptr(), work.data_ptr(),
            None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
            None if lora is None else ctypes.byref(lora))
        self._check(rc, "general")
        rows = tokens.sample_rows
        norm = m.model.norm
        out, _ = rms_norm(hidden[rows].contiguous(), norm.weight, norm.eps, residual[rows].contiguous())
        return out
