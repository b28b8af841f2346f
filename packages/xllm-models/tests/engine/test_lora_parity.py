"""Multi-LoRA (xllm.models.lora, xllm.core.lora) against Hugging Face transformers + PEFT.

Tiny random Llama, Qwen3 and Qwen3-MoE checkpoints, three random PEFT adapters each (made by ``get_peft_model``
+ ``save_pretrained``, A and B randomised: PEFT initialises B to zero) on different projections and ranks, one
with rsLoRA scaling. Qwen3-MoE: PEFT turns MLP targets into its experts' parameters (``target_parameters``
``gate_up_proj`` / ``down_proj``, with ``rank_pattern`` / ``alpha_pattern`` doubling gate_up's rank and alpha):
beta has every attention projection and both expert parameters (rsLoRA), gamma ``o_proj`` and the experts'
``down_proj`` named in ``target_parameters``, alpha attention only. Oracle (fp32 both sides), by teacher
forcing: HF+PEFT with the request's adapter (or the base model) runs one forward over prompt + our output; its
argmax at every generated position is our token and ``|our logprob - HF log_softmax| < 1e-3``. Checked with the
three adapters and the base model in one batch (on xtensor, where the dense models' steps run fused, the
kernels adding each row's adapter, with and without async scheduling, and on paged KV with chunked prefill,
eager), after an adapter was evicted and reloaded (one
slot), loaded at run time, with the prefix cache (one prompt under two adapters gives each adapter's output,
never the other's KV; a second request of the same adapter reuses its blocks) and through a prefill/decode
hand-off.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from xllm.engine_api.errors import ConfigError, EngineOverloadedError, InvalidRequestError
from xllm.models import load_model
from xllm.models.lora import LoraAdapterError, read_peft_adapter
from xllm.models.moe import SparseMoeBlock
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import HandoffListener, generate, make_engine, make_request
from xllm.testing.models import IdTokenizer, save_random_hf_model, save_random_lora, tiny_qwen3_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NEW = 12
LOGPROB_TOL = 1e-3
# name -> (rank, alpha, target modules, rslora); Qwen3-MoE: MOE_ADAPTERS
ADAPTERS = {
    "alpha": (4, 8, ["q_proj", "v_proj"], False),
    "beta": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "gamma": (2, 4, ["o_proj", "down_proj", "up_proj"], False),
}


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=503, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_qwen3_moe_config():
    # a dense layer (adapters on its MLP too) between sparse ones (adapters on their attention only)
    return transformers.Qwen3MoeConfig(
        vocab_size=499, hidden_size=64, intermediate_size=80, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=512, rms_norm_eps=1e-6)


CONFIGS = {"llama": tiny_llama_config, "qwen3": tiny_qwen3_config, "qwen3_moe": tiny_qwen3_moe_config}
# Qwen3-MoE: name -> (target modules, target parameters): its MLP targets become expert parameters (PEFT's
# transformers-5 conversion: gate_proj + up_proj -> gate_up_proj of rank 2r, down_proj -> down_proj)
MOE_ADAPTERS = {
    "alpha": (["q_proj", "v_proj"], None),
    "beta": (ADAPTERS["beta"][2], None),
    "gamma": (["o_proj"], ["mlp.experts.down_proj"]),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request, tmp_path_factory):
    """(base dir, {adapter: dir}, our model)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = root / "base"
    save_random_hf_model(base, CONFIGS[request.param](), seed=3, std=0.15)
    adapters = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        parameters = None
        if request.param == "qwen3_moe":
            targets, parameters = MOE_ADAPTERS[name]
        adapters[name] = save_random_lora(base, root / name, rank, alpha, targets, rslora, seed=11 + i,
                                          parameters=parameters)
    return base, adapters, load_model(base, torch.float32)


@torch.inference_mode()
def hf_rows(base: pathlib.Path, adapter: pathlib.Path | None, prompt: list[int], output: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = torch.tensor([prompt + output[:-1]])
    return hf(input_ids=ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)


def check_hf(base, adapter, prompt, tokens, logprobs) -> None:
    rows = hf_rows(base, adapter, prompt, tokens)
    assert rows.argmax(-1).tolist() == tokens, f"adapter {adapter}: tokens differ from HF+PEFT's"
    diff = (rows[torch.arange(len(tokens)), torch.tensor(tokens)] - torch.tensor(logprobs)).abs().max().item()
    assert diff < LOGPROB_TOL, f"adapter {adapter}: logprob differs from HF+PEFT by {diff}"


def request(rid: str, prompt: list[int], lora: str = "", max_tokens: int = NEW) -> engine_pb2.GenerateRequest:
    req = make_request(rid, prompt, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    req.lora_name = lora
    return req


def prompts(n: int, length: int = 21, vocab: int = 400) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def engine_for(model, adapters: dict, **config):
    return make_engine(model, tokenizer=IdTokenizer(), lora_modules={n: str(p) for n, p in adapters.items()},
                       **config)


@pytest.mark.parametrize(("backend", "overlapped"), [("xtensor", False), ("paged", False), ("xtensor", True)],
                         ids=["xtensor", "paged-chunked", "xtensor-async"])
def test_three_adapters_and_base_in_one_batch(arch, backend, overlapped):
    base, adapters, model = arch
    extra = {"block_size": 8, "max_num_batched_tokens": 24} if backend == "paged" else {}
    engine = engine_for(model, adapters, kv_backend=backend, async_scheduling=overlapped, **extra)
    try:
        ps = prompts(5)
        ps.append(ps[0])  # alpha's prompt again, for the base model
        names = ["alpha", "beta", "", "gamma", "beta", ""]
        reqs = [request(f"r{i}", p, lora) for i, (p, lora) in enumerate(zip(ps, names, strict=True))]
        got = generate(engine, reqs)
        assert engine.counters.max_batch_size == 6  # every request (three adapters and the base model) in one step
        steps = engine.runner.mode_steps
        if engine.runner.fused is not None:  # the fused native steps add each row's adapter (lora_step.h)
            assert steps["native"] + steps["native_step"] > 0 and steps["eager"] == 0, steps
        else:
            assert steps["eager"] > 0 and steps["native"] == steps["native_step"] == 0, steps
    finally:
        engine.close()
    for i, (p, lora) in enumerate(zip(ps, names, strict=True)):
        assert got.final[f"r{i}"].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        check_hf(base, adapters.get(lora), p, got.tokens[f"r{i}"], got.logprobs[f"r{i}"])
    assert got.tokens["r0"] != got.tokens["r5"]  # the adapter changes the output


def test_evicted_adapter_reloads(arch):
    """One slot: each adapter in turn evicts the other; the reloaded adapter gives the same tokens. While a
    request of one adapter runs, another adapter's request waits for the slot (parked, then run once the slot
    is free); the base model needs none."""
    base, adapters, model = arch
    engine = engine_for(model, adapters, max_loras=1)
    try:
        p = prompts(1)[0]
        runs = {}
        for i, lora in enumerate(["alpha", "gamma", "alpha"]):
            got = generate(engine, [request(f"{lora}{i}", p, lora)])
            runs[f"{lora}{i}"] = (got.tokens[f"{lora}{i}"], got.logprobs[f"{lora}{i}"])
        assert engine.loras.resident == ["alpha"]
        assert runs["alpha0"] == runs["alpha2"] and runs["alpha0"][0] != runs["gamma1"][0]
        report = engine.load_report()  # what routers weigh: alpha resident, its slot free (no live request)
        assert (list(report.lora_resident), report.lora_slots_free, report.lora_parked) == (["alpha"], 1, 0)
        assert engine.loras.loads == 2 and report.lora_load_seconds > 0  # gamma, then alpha again, read in
        engine.add_request(request("busy", p, "beta"))
        engine.add_request(request("waits", p, "alpha"))
        engine.add_request(request("base", p))
        assert [seq.request_id for seq, _ in engine.loras.parked] == ["waits"]
        report = engine.load_report()
        assert (list(report.lora_resident), report.lora_slots_free, report.lora_parked) == (["beta"], 0, 1)
        got = generate(engine, [])
        assert set(got.final) == {"busy", "waits", "base"} and not engine.loras.parked
        assert (got.tokens["waits"], got.logprobs["waits"]) == runs["alpha0"]
    finally:
        engine.close()
    check_hf(base, adapters["alpha"], p, *runs["alpha2"])
    check_hf(base, adapters["gamma"], p, *runs["gamma1"])
    check_hf(base, adapters["beta"], p, got.tokens["busy"], got.logprobs["busy"])


def test_prefix_cache_is_keyed_by_adapter(arch):
    """One prompt of several blocks: under two adapters and the base model each output is its own (HF+PEFT's);
    the second request of an adapter hits the cache, a request of another adapter does not."""
    base, adapters, model = arch
    engine = engine_for(model, {"alpha": adapters["alpha"], "beta": adapters["beta"]}, kv_backend="paged",
                        block_size=8)
    try:
        p = prompts(1, length=40)[0]
        out = {}
        hits = []
        for rid, lora in [("a1", "alpha"), ("b1", "beta"), ("base", ""), ("a2", "alpha"), ("b2", "beta")]:
            before = engine.kv.prefix_stats.hits
            got = generate(engine, [request(rid, p, lora)])
            out[rid] = (got.tokens[rid], got.logprobs[rid])
            hits.append(engine.kv.prefix_stats.hits - before)
    finally:
        engine.close()
    assert hits[:3] == [0, 0, 0] and hits[3] > 0 and hits[4] > 0
    assert out["a1"][0] == out["a2"][0] and out["b1"][0] == out["b2"][0]
    assert len({tuple(out[r][0]) for r in ("a1", "b1", "base")}) == 3
    for rid, lora in [("a2", "alpha"), ("b2", "beta"), ("base", "")]:
        check_hf(base, adapters.get(lora), p, *out[rid])


def test_adapter_identity_seeds_block_hashes(arch, tmp_path):
    """The same adapter files (another directory, another name) hash alike; another adapter does not."""
    import shutil

    _, adapters, model = arch
    copy = shutil.copytree(adapters["alpha"], tmp_path / "alpha-copy")
    engine = engine_for(model, {"alpha": adapters["alpha"], "again": copy, "beta": adapters["beta"]},
                        kv_backend="paged", block_size=8)
    try:
        roots = dict(zip(engine.lora_names(), engine.lora_hash_roots(), strict=True))
        assert roots["alpha"] == roots["again"] != roots["beta"] and 0 not in roots.values()
        assert engine.loras.roots["alpha"] == read_peft_adapter(adapters["alpha"], 16).identity
    finally:
        engine.close()


def test_load_unload_at_run_time_and_refusals(arch):
    base, adapters, model = arch
    engine = engine_for(model, {"alpha": adapters["alpha"]})
    try:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(request("x", [5, 6, 7], "nope"))
        assert err.value.param == "model" and "nope" in str(err.value)
        with pytest.raises(InvalidRequestError) as err:
            engine.load_lora("alpha", str(adapters["beta"]))
        assert err.value.param == "lora_name"
        with pytest.raises(InvalidRequestError) as err:
            engine.load_lora("other", str(base))  # a model directory, not an adapter
        assert err.value.param == "lora_path" and "adapter_config.json" in str(err.value)
        engine.load_lora("late", str(adapters["gamma"]))
        assert engine.lora_names() == ["alpha", "late"]
        p = prompts(1)[0]
        engine.add_request(request("late0", p, "late"))
        with pytest.raises(InvalidRequestError, match="in use"):
            engine.unload_lora("late")
        got = generate(engine, [])
        engine.unload_lora("late")
        assert engine.lora_names() == ["alpha"]
        with pytest.raises(InvalidRequestError):
            engine.validate(request("late1", p, "late"))  # (checked before queuing, on any thread)
        beam = make_request("beam", p, max_tokens=4, beam_width=2)
        beam.lora_name = "alpha"
        with pytest.raises(InvalidRequestError, match="beam search"):
            engine.add_request(beam)
        assert not engine.requests
    finally:
        engine.close()
    check_hf(base, adapters["gamma"], p, got.tokens["late0"], got.logprobs["late0"])


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("use_dora", True, "use_dora"), ("bias", "all", "bias"), ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("r", 64, "--max-lora-rank"), ("rank_pattern", {"q_proj": 2}, "rank_pattern"),
    ("target_parameters", ["mlp.gate.weight"], "target_parameters entry 'mlp.gate.weight'"),
])
def test_unsupported_adapter_config_refused(arch, tmp_path, field, value, needle):
    import json
    import shutil

    _, adapters, model = arch
    bad = shutil.copytree(adapters["alpha"], tmp_path / "bad")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg[field] = value
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraAdapterError, match=needle):
        read_peft_adapter(bad, 16)
    with pytest.raises(ConfigError, match="--lora-modules bad="):
        engine_for(model, {"bad": bad}).close()


def _hand_off(prefill, decode, rid: str, prompt: list[int], lora: str):
    """One request through a prefill/decode hand-off (the KV pages copied as the fd transport does); returns
    its chunks and the decode side's reservation."""
    from xllm.testing.engine import Collected

    req = request(rid, prompt, lora)
    req.disagg_phase = engine_pb2.DISAGG_PHASE_DECODE
    decode.add_request(req)
    client = Collected()
    client.add(decode.step())
    reservation = decode.disagg.reserved[rid]
    req = request(rid, prompt, lora)
    req.disagg_phase = engine_pb2.DISAGG_PHASE_PREFILL
    req.kv_target.CopyFrom(engine_pb2.KVTarget(transfer_id=rid, matched_tokens=reservation.matched_tokens,
                                               layout=decode.layout.fingerprint))
    prefill.add_request(req)
    while rid not in prefill.disagg.handoffs:
        client.add(c for c in prefill.step() if c.finish_reason != engine_pb2.FINISH_REASON_HANDED_OFF)
    handoff = prefill.disagg.handoffs[rid]
    src, dst, bs = prefill.kv.page_store(), decode.kv.page_store(), prefill.layout.block_size
    for j in range(reservation.matched_tokens // bs, -(-reservation.num_tokens // bs)):
        dst.write_block(reservation.pages[j], src.read_block(handoff.pages[j]))
    client.add(decode.install_kv(engine_pb2.KVCommit(transfer_id=rid, num_tokens=handoff.num_tokens,
                                                     first_token=handoff.first_token)))
    prefill.release_kv(rid)
    while decode.has_work():
        client.add(decode.step())
    return client, reservation


def test_pd_handoff_keyed_by_adapter(arch):
    """Prefill and decode instances (each its own copy of the model, the same adapters): each adapter's output
    through the hand-off equals HF+PEFT's; the decode side's prefix cache offers a prompt's blocks to a later
    request of the same adapter, never to another adapter's."""
    base, adapters, _ = arch
    engines = [engine_for(load_model(base, torch.float32), adapters) for _ in range(2)]
    prefill, decode = engines
    try:
        for e in engines:
            e.attach_disagg(HandoffListener())
        p = prompts(1, length=3 * prefill.layout.block_size // 2)[0]
        out, matched = {}, {}
        for rid, lora in [("a1", "alpha"), ("b1", "beta"), ("a2", "alpha")]:
            client, reservation = _hand_off(prefill, decode, rid, p, lora)
            out[rid] = (client.tokens[rid], client.logprobs[rid])
            matched[rid] = reservation.matched_tokens
    finally:
        for e in engines:
            e.close()
    assert matched["a1"] == matched["b1"] == 0 and matched["a2"] == prefill.layout.block_size
    assert out["a1"] == out["a2"]
    check_hf(base, adapters["alpha"], p, *out["a1"])
    check_hf(base, adapters["beta"], p, *out["b1"])


def test_moe_expert_adapters_read(arch):
    """The Qwen3-MoE adapters' expert weights land on the sparse layers' experts (0 and 2, not the dense 1) with
    PEFT's per-parameter rank and scale (beta: gate_up of rank 2r and alpha 2 alpha, rsLoRA; gamma: down only)."""
    _, adapters, model = arch
    if not isinstance(model.model.layers[0].mlp, SparseMoeBlock):
        assert all(not read_peft_adapter(p, 16).experts for p in adapters.values())
        return
    beta, gamma = (read_peft_adapter(adapters[n], 16) for n in ("beta", "gamma"))
    assert sorted(beta.experts) == [(0, "down_proj"), (0, "gate_up_proj"), (2, "down_proj"), (2, "gate_up_proj")]
    assert sorted(gamma.experts) == [(0, "down_proj"), (2, "down_proj")]
    up, down = beta.experts[(0, "gate_up_proj")], beta.experts[(0, "down_proj")]
    assert (up.rank, up.a.shape, up.b.shape) == (16, (4, 16, 64), (4, 64, 16))
    assert (down.rank, down.a.shape, down.b.shape) == (8, (4, 8, 32), (4, 64, 8))
    assert up.scale == pytest.approx(32 / 16 ** 0.5) and down.scale == pytest.approx(16 / 8 ** 0.5)


def _expert_adapter(path: pathlib.Path, targets: list[str], tensors: dict[str, torch.Tensor], **cfg) -> pathlib.Path:
    """A hand-written adapter directory with expert weights (``layers.N.mlp.experts...`` keys)."""
    import json

    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                          "target_parameters": targets, **cfg}))
    prefix = "base_model.model.model.layers."
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def test_expert_adapter_refusals(arch, tmp_path):
    """Expert weights that do not fit the model's experts (another expert count, a model without MoE blocks), a
    wrapper nesting that target_parameters does not name, a rank_pattern rank above the limit: refused, named."""
    _, _, model = arch
    stack = model.lora_stack(4, 16)  # (the engines' default sizes: they get the same stack back)
    fits = {"0.mlp.experts.lora_A.weight": torch.randn(8, 32), "0.mlp.experts.lora_B.weight": torch.randn(64, 8)}
    adapter = _expert_adapter(tmp_path / "down", ["mlp.experts.down_proj"], fits)
    if isinstance(model.model.layers[0].mlp, SparseMoeBlock):
        assert set(stack.read(adapter).experts) == {(0, "down_proj")}
    else:
        with pytest.raises(LoraAdapterError, match="no sparse MoE block"):
            stack.read(adapter)
    three = {"0.mlp.experts.lora_A.weight": torch.randn(6, 32), "0.mlp.experts.lora_B.weight": torch.randn(64, 6)}
    with pytest.raises(LoraAdapterError, match=r"3 experts.* do not fit|no sparse MoE block"):
        stack.read(_expert_adapter(tmp_path / "three", ["mlp.experts.down_proj"], three))
    deep = {k.replace("experts.", "experts.base_layer."): v for k, v in fits.items()}
    with pytest.raises(LoraAdapterError, match="names 1 expert parameter"):
        read_peft_adapter(_expert_adapter(tmp_path / "deep", ["mlp.experts.down_proj"], deep), 16)
    with pytest.raises(LoraAdapterError, match=r"rank_pattern gives .*--max-lora-rank 16"):
        read_peft_adapter(_expert_adapter(tmp_path / "big", ["mlp.experts.down_proj"], fits,
                                          rank_pattern={r".*\.down_proj": 32}), 16)


def test_async_engine_loads_and_unloads_between_steps(arch):
    """The engine service's handle: ``AsyncEngine.load_lora(name, path)`` registers an adapter between steps
    (then requests name it), ``load_lora(name, None)`` unloads it; failures come back on the future."""
    import asyncio

    from xllm.core.async_engine import AsyncEngine

    base, adapters, model = arch
    engine = engine_for(model, {})
    aeng = AsyncEngine(engine)
    p = prompts(1)[0]

    async def run():
        await aeng.load_lora("beta", str(adapters["beta"]))
        stream = aeng.submit(request("b", p, "beta"))
        chunks = [c async for c in stream]
        with pytest.raises(InvalidRequestError):
            await aeng.load_lora("beta", str(adapters["alpha"]))
        await aeng.load_lora("beta", None)
        with pytest.raises(InvalidRequestError):
            aeng.submit(request("b2", p, "beta"))
        return chunks

    aeng.start()
    try:
        chunks = asyncio.run(run())
    finally:
        aeng.shutdown()
        engine.close()
    tokens = [t for c in chunks for t in c.token_ids]
    check_hf(base, adapters["beta"], p, tokens, [lp.logprob for c in chunks for lp in c.logprobs])


def test_parked_requests_abort_and_bound(arch):
    """A request waiting for a slot can be aborted (it never ran) and its adapter cannot be unloaded meanwhile;
    beyond ``max_waiting_requests`` parked requests the engine answers overloaded."""
    _, adapters, model = arch
    engine = engine_for(model, adapters, max_loras=1, max_waiting_requests=2)
    try:
        p = prompts(1)[0]
        engine.add_request(request("busy", p, "beta"))
        engine.add_request(request("w1", p, "alpha"))
        engine.add_request(request("w2", p, "gamma"))
        with pytest.raises(EngineOverloadedError):
            engine.add_request(request("w3", p, "alpha"))
        with pytest.raises(InvalidRequestError, match="waiting for a slot"):
            engine.unload_lora("gamma")
        final = engine.abort("w1")
        assert final.finish_reason == engine_pb2.FINISH_REASON_ABORT
        got = generate(engine, [])
        assert set(got.final) == {"busy", "w2"} and not engine.loras.parked and not engine.requests
        engine.unload_lora("gamma")
    finally:
        engine.close()
