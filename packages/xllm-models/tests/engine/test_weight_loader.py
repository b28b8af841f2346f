"""load_model on tiny random checkpoints written by transformers' save_pretrained:
same logits as HF, file-order iteration, fused qkv / gate_up assembly, load errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm.core import EngineConfig, LLMEngine
from xllm.models import load_model
from xllm.models.loader import iter_safetensors, shard_files, tensor_names_in_file_order
from xllm.models.weights import WeightLoadError
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import save_random_hf_model
from xllm.testing.reference import full_logits

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=1000, max_position_embeddings=256, num_hidden_layers=2)
VARIANTS = {
    # q size (4 x 48 = 192) != hidden (96); a single KV head; separate lm_head
    "head_dim48_1kv": dict(hidden_size=96, intermediate_size=100, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=48, tie_word_embeddings=False),
    # head_dim 40 from hidden / heads, tied embeddings, llama3 RoPE scaling, 4 shard files
    "head_dim40_tied_llama3_sharded": dict(
        hidden_size=80, intermediate_size=120, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=3, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # attention and MLP biases (HF puts them on q, k, v, o, gate, up, down)
    "biases": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
    # linear RoPE scaling, 3 KV heads of 6 query heads, head_dim 16
    "linear_rope": dict(hidden_size=96, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3,
                        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


def hf_config(name: str):
    kw = {**BASE, **VARIANTS[name]}
    return transformers.LlamaConfig(**kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (model dir, HF model)."""
    out = {}
    for i, name in enumerate(VARIANTS):
        path = tmp_path_factory.mktemp(name)
        shard = "150KB" if "sharded" in name else "100MB"
        out[name] = (path, save_random_hf_model(path, hf_config(name), seed=i, max_shard_size=shard))
    mistral = tmp_path_factory.mktemp("mistral")
    cfg = transformers.MistralConfig(**BASE, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, sliding_window=None)
    out["mistral"] = (mistral, save_random_hf_model(mistral, cfg, seed=9))
    return out


@pytest.mark.parametrize("name", [*VARIANTS, "mistral"])
def test_logits_match_hf(saved, name):
    path, hf = saved[name]
    model = load_model(path, torch.float32, progress=False)
    ids = torch.randint(0, 1000, (120,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    ours = full_logits(model, ids.tolist())
    assert ours.shape == ref.shape == (120, 1000)
    scale = ref.abs().max().item()
    assert scale > 1.0  # weights are large enough for a meaningful comparison
    assert (ours - ref).abs().max().item() < 1e-4 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_engine_on_a_tiny_checkpoint_matches_hf_greedy(saved):
    """The whole path (loader + engine KV cache + batching) on the odd-shaped model."""
    path, hf = saved["head_dim48_1kv"]
    model = load_model(path, torch.float32, progress=False)

    class Tok:
        eos_token_ids = frozenset()

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    eng = LLMEngine(model, Tok(), EngineConfig(dtype=torch.float32, max_model_len=256, max_num_seqs=4,
                                               max_num_batched_tokens=16, num_threads=1))
    prompts = [[5, 17, 900, 3], list(range(100, 140)), [999]]
    for i, p in enumerate(prompts):
        eng.add_request(engine_pb2.GenerateRequest(request_id=str(i), prompt_token_ids=p, sampling=engine_pb2.
                                                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for c in eng.step():
            out.setdefault(c.request_id, []).extend(c.token_ids)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            rows = hf(torch.tensor([p + out[str(i)][:-1]])).logits[0, len(p) - 1:]
        assert rows.argmax(-1).tolist() == out[str(i)]


def test_fused_parameters_are_the_stacked_checkpoint_tensors(saved):
    path, _ = saved["biases"]
    model = load_model(path, torch.float32, progress=False)
    ckpt = load_file(str(path / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    for kind in ("weight", "bias"):
        qkv = torch.cat([ckpt[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv"])
        gate_up = torch.cat([ckpt[f"{p}mlp.{n}_proj.{kind}"] for n in ("gate", "up")])
        assert torch.equal(getattr(attn.qkv_proj, kind), qkv)
        assert torch.equal(getattr(mlp.gate_up_proj, kind), gate_up)
    assert torch.equal(attn.o_proj.bias, ckpt[f"{p}self_attn.o_proj.bias"])
    assert model.lm_head is None or torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])


def test_parameters_are_allocated_in_the_requested_dtype(saved):
    path, hf = saved["head_dim48_1kv"]
    model = load_model(path, torch.bfloat16, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    ref = hf.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(model.model.embed_tokens.weight, ref)


def _header(path):
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def test_tensors_are_read_in_file_byte_order(tmp_path):
    # safetensors lays out larger dtypes first: byte order differs from name order here
    tensors = {"a.small": torch.zeros(3, dtype=torch.float16), "b.mid": torch.zeros(5, dtype=torch.float32),
               "z.big": torch.zeros(2, dtype=torch.float64), "c.mid": torch.ones(4, dtype=torch.float32)}
    f = tmp_path / "x.safetensors"
    save_file(tensors, str(f))
    header = _header(f)
    by_offset = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    assert by_offset != sorted(tensors)  # the test is only meaningful if the orders differ
    assert tensor_names_in_file_order(f) == by_offset
    assert [n for n, _ in iter_safetensors([f], progress=False)] == by_offset
    assert {n: t.dtype for n, t in iter_safetensors([f], progress=False)} == {n: t.dtype for n, t in tensors.items()}


def test_sharded_checkpoints_are_read_shard_by_shard(saved):
    path, _ = saved["head_dim40_tied_llama3_sharded"]
    files = shard_files(path)
    assert len(files) >= 3 and files == sorted(files)
    names = [n for n, _ in iter_safetensors(files, progress=False)]
    expected = [n for f in files for n in tensor_names_in_file_order(f)]
    assert names == expected
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(names) == sorted(index)


def _copy_model(src, dst, edit):
    """Copy a single-file model dir, editing its tensor dict with ``edit``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit,match", [
    pytest.param(lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
                 r"missing \['model\.layers\.1\.self_attn\.qkv_proj", id="missing-k-shard"),
    pytest.param(lambda t: t.pop("model.layers.0.mlp.up_proj.weight"),
                 r"missing \['model\.layers\.0\.mlp\.gate_up_proj", id="missing-up-shard"),
    pytest.param(lambda t: t.pop("model.layers.0.input_layernorm.weight"),
                 r"missing \['model\.layers\.0\.input_layernorm", id="missing-norm"),
    pytest.param(lambda t: t.pop("lm_head.weight"), r"missing \['lm_head\.weight'\]", id="missing-lm-head"),
    pytest.param(lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
                 r"unexpected \['model\.layers\.0\.extra", id="unexpected"),
    pytest.param(lambda t: t.update({"model.norm.weight": torch.zeros(95)}),
                 r"model\.norm\.weight: checkpoint shape", id="misshapen"),
    pytest.param(lambda t: t.update({"model.layers.0.self_attn.v_proj.weight": torch.zeros(48, 95)}),
                 r"v_proj.*shard 'v'", id="misshapen-shard"),
])
def test_checkpoint_mismatches_raise_weight_load_error(saved, tmp_path, edit, match):
    src, _ = saved["head_dim48_1kv"]
    bad = _copy_model(src, tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError, match=match):
        load_model(bad, torch.float32, progress=False)


def test_no_weights_at_all(tmp_path, saved):
    src, _ = saved["head_dim48_1kv"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, progress=False)
