"""The fused native Llama steps of a tensor-parallel shard: two ranks (this process and one spawned peer)
over a shared-memory group (``ShmComm``), each running ``FusedLlamaForward.step`` (the general step: two
prefill chunks) and ``__call__`` (the decode step: two rows) over its own slot KV (its KV heads only), with
the O and down projections all-reduced inside the native call.

Oracle: the one-process model's eager forward (plain causal attention over each whole sequence, tested
against HF elsewhere): every rank's final hidden states match it and the greedy tokens are its tokens.
The shapes are SmolLM2's GQA split (9 query / 3 KV heads: rank 0 holds KV heads 0-1 and 6 query heads,
rank 1 KV head 2 and 3 query heads), an odd vocabulary and an intermediate split on 32-blocks.
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from xllm.core.model_api import StepTokens
from xllm.core.parallel import CollectiveError
from xllm.core.parallel.shm import ShmComm
from xllm.kernels import native
from xllm.models import load_model
from xllm.testing.models import save_random_hf_model
from xllm.testing.reference import DenseContext

transformers = pytest.importorskip("transformers")
mp = pytest.importorskip("torch.multiprocessing")
pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None or not ShmComm.available(),
                                reason="native kernels unavailable")

TP = 2
PROMPTS = [[3, 17, 250, 11, 499, 42, 7, 128, 64, 200, 5], [9, 300, 77, 41, 150]]
DECODE_STEPS = 4
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # max |fused - eager| relative to max |eager|


@dataclass(eq=False)
class SlotCache:
    """Per-slot contiguous K/V rows of every layer (the xTensor layout the fused steps bind)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    kv_quant_kind: str | None = None

    @classmethod
    def for_model(cls, model, slots: int = 2, max_len: int = 32) -> SlotCache:
        spec = model.kv_cache_spec()  # the rank's own KV heads
        shape = (slots, max_len, spec.num_kv_heads, spec.head_dim)
        return cls([torch.zeros(shape, dtype=model.dtype) for _ in range(spec.num_layers)],
                   [torch.zeros(shape, dtype=model.dtype) for _ in range(spec.num_layers)])

    def layer_kv(self, layer: int):
        return self.k[layer], self.v[layer]


def _model_dir(root):
    cfg = transformers.LlamaConfig(vocab_size=501, hidden_size=288, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=32,
                                   tie_word_embeddings=True, max_position_embeddings=128, rms_norm_eps=1e-6)
    save_random_hf_model(root, cfg, seed=21)
    return root


def _fused_run(model) -> dict:
    """Both prompts prefilled in one general step (slots 0 and 1), then DECODE_STEPS decode steps of both
    rows, greedy: every step's final hidden states and the tokens."""
    fused = model.fused_forward()
    kv = SlotCache.for_model(model)
    lens = [len(p) for p in PROMPTS]
    ids = torch.tensor(PROMPTS[0] + PROMPTS[1])
    tokens = StepTokens(
        input_ids=ids, positions=torch.tensor([*range(lens[0]), *range(lens[1])]),
        token_slots=torch.tensor([0] * lens[0] + [1] * lens[1]), seq_starts=torch.tensor([0, lens[0], sum(lens)]),
        context_lens=torch.tensor(lens), seq_slots=torch.tensor([0, 1]), sample_rows=torch.arange(sum(lens)))
    hidden = [fused.step(tokens, kv)]
    last = hidden[0][[lens[0] - 1, sum(lens) - 1]]
    seqs = [list(p) for p in PROMPTS]
    for _ in range(DECODE_STEPS):
        nxt = model.compute_greedy(last)
        for s, t in zip(seqs, nxt.tolist(), strict=True):
            s.append(t)
        positions = torch.tensor([len(s) - 1 for s in seqs])
        last = fused(nxt, positions, torch.tensor([0, 1]), kv)
        hidden.append(last)
    return {"hidden": hidden, "seqs": seqs}


def _eager_run(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The one-process eager hidden states the fused run's steps should give, from its final sequences."""
    full = [model.forward(torch.tensor(s), torch.arange(len(s)), DenseContext()) for s in seqs]
    lens = [len(p) for p in PROMPTS]
    out = [torch.cat([full[0][: lens[0]], full[1][: lens[1]]])]
    for k in range(DECODE_STEPS):
        out.append(torch.stack([full[0][lens[0] + k], full[1][lens[1] + k]]))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("tp_fused"))


def _two_ranks(path, dtype) -> list[dict]:
    """Rank 0 here, rank 1 spawned; both results."""
    comm, name = ShmComm.create(TP, max_bytes=4096, timeout_s=120)  # small buffer: steps go in pieces
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    peer = ctx.Process(target=_peer, args=(name, str(path), dtype, out))
    peer.start()
    try:
        torch.set_num_threads(2)
        model = load_model(path, dtype, progress=False, tp_rank=0, tp_size=TP, comm=comm)
        assert model.fused_forward() is not None
        with torch.inference_mode():
            mine = {**_fused_run(model), "kv_heads": model.kv_cache_spec().num_kv_heads}
        rank, theirs = out.get(timeout=300)
        assert rank == 1 and isinstance(theirs, bytes), theirs
        return [mine, torch.load(io.BytesIO(theirs))]
    finally:
        peer.join(60)
        if peer.is_alive():
            peer.kill()
        comm.close()


def _peer(name, path, dtype, out) -> None:
    torch.set_num_threads(2)
    comm = ShmComm.attach(name, 1, TP, timeout_s=120)
    try:
        model = load_model(path, dtype, progress=False, tp_rank=1, tp_size=TP, comm=comm)
        assert model.fused_forward() is not None
        with torch.inference_mode():
            buf = io.BytesIO()  # bytes, not tensors: a queued tensor's shared memory dies with this process
            torch.save({**_fused_run(model), "kv_heads": model.kv_cache_spec().num_kv_heads}, buf)
            out.put((1, buf.getvalue()))
    except BaseException as e:  # reported to the parent's assertion, then re-raised
        out.put((1, repr(e)))
        raise
    finally:
        comm.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_shm_ranks_run_the_fused_steps_like_one_process(model_dir, dtype):
    ranks = _two_ranks(model_dir, dtype)
    assert [r["kv_heads"] for r in ranks] == [2, 1]  # each rank's KV memory holds its own heads
    one = load_model(model_dir, dtype, progress=False)
    with torch.inference_mode():
        expected = _eager_run(one, ranks[0]["seqs"])
        if dtype == torch.float32:  # greedy decoding from the reference's own hidden states: the same tokens
            seqs = [list(p) for p in PROMPTS]
            for _ in range(DECODE_STEPS):
                last = torch.stack([one.forward(torch.tensor(s), torch.arange(len(s)), DenseContext())[-1]
                                    for s in seqs])
                for s, t in zip(seqs, one.compute_greedy(last).tolist(), strict=True):
                    s.append(t)
            assert ranks[0]["seqs"] == seqs
    assert ranks[0]["seqs"] == ranks[1]["seqs"]
    for step, (h0, h1, ref) in enumerate(zip(ranks[0]["hidden"], ranks[1]["hidden"], expected, strict=True)):
        assert torch.equal(h0, h1), f"step {step}: the ranks disagree"  # bit-identical all-reduce sums
        err = (h0.float() - ref.float()).abs().max().item()
        assert err < TOL[dtype] * ref.float().abs().max().item(), f"step {step}: max |fused - eager| = {err}"


def test_a_shard_without_a_shm_group_takes_the_eager_path(model_dir):
    model = load_model(model_dir, torch.float32, progress=False, tp_rank=0, tp_size=TP)  # no comm: SingleRank
    assert model.fused_forward() is None


def test_a_rank_that_never_steps_fails_the_fused_step_within_the_timeout(model_dir):
    comm, name = ShmComm.create(TP, timeout_s=0.5)
    idle = ShmComm.attach(name, 1, TP, timeout_s=0.5)  # attached, never steps
    try:
        torch.set_num_threads(2)
        model = load_model(model_dir, torch.float32, progress=False, tp_rank=0, tp_size=TP, comm=comm)
        fused = model.fused_forward()
        kv = SlotCache.for_model(model)
        # rank 1 takes part in the embedding's all-reduce (in Python), then never again: the kernel's first
        # all-reduce (after layer 0's O projection) waits for it
        peer = threading.Thread(target=idle.all_reduce, args=(torch.zeros(1, model.cfg.hidden_size),))
        peer.start()
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=r"fused decode step's all_reduce.*timed out.*\[1\]"), \
                torch.inference_mode():
            fused(torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), kv)
        assert time.monotonic() - start < 5
        peer.join(10)
        with pytest.raises(CollectiveError, match="earlier collective"):  # the group is unusable afterwards
            comm.barrier()
    finally:
        idle.close()
        comm.close()
