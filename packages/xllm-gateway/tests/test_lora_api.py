"""LoRA adapters through the OpenAI API (``xllm serve --lora-modules``): a tiny Llama with two random PEFT
adapters, one engine in this process. ``/v1/models`` lists the adapters under their base model; a request
naming an adapter is answered with that adapter's weights, equal to HF + PEFT's greedy generation, and the
base model's name gives the base model's (HF's); a name nobody serves is a 404."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from xllm.core import EngineConfig
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.testing.models import save_random_lora, save_tiny_llama

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPT = [1, 504, 9087, 314, 28, 4031, 3110, 1004, 42, 711]
NEW = 10
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("lora-api")
    base = save_tiny_llama(root / "base", smollm2_dir)
    adapters = {"sql": save_random_lora(base, root / "sql", 8, 16, TARGETS, seed=11),
                "chat": save_random_lora(base, root / "chat", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=12)}
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, max_num_seqs=4,
                       num_threads=1, lora_modules={n: str(p) for n, p in adapters.items()}, max_loras=2)
    app = build_embedded(ServeOptions(model=str(base), served_model_name="base", engine=cfg, progress=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, base, adapters


@torch.inference_mode()
def _hf_text(base, adapter, tokenizer_dir) -> str:
    """The oracle: HF transformers (+ PEFT) greedy generation, decoded with the model's tokenizer."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok.decode(out[0, len(PROMPT):].tolist(), skip_special_tokens=True)


def test_adapters_are_models_answering_as_hf_with_peft(served):
    client, base, adapters = served
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("base", None), ("chat", "base"), ("sql", "base")]
    texts = {}
    for name, adapter in (("base", None), ("sql", adapters["sql"]), ("chat", adapters["chat"])):
        r = client.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": NEW,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        texts[name] = r.json()["choices"][0]["text"]
        assert texts[name] == _hf_text(base, adapter, base), name
    assert len(set(texts.values())) == 3  # three weights, three answers
    r = client.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_routing_sends_an_adapter_only_where_it_is_and_hashes_its_own_kv(smollm2_tokenizer, fake_tokens):
    """Three instances of one model, the adapter registered on two: its requests go to those (matched in the KV
    index by block hashes chained from the adapter's root, as the engine keys its KV), the base model's to any."""
    from xllm.gateway.registry import EmbeddedRegistry
    from xllm.gateway.router import Router
    from xllm.kvstore import block_hashes
    from xllm.proto.registry.v1 import instance_pb2
    from xllm.testing.fakes import FakeEngineClient, make_info

    registry = EmbeddedRegistry()
    for iid, loras in (("plain", ()), ("tuned-1", ("sql",)), ("tuned-2", ("sql",))):
        info = make_info(iid)
        info.model.block_size = 4
        info.model.lora_names.extend(loras)
        info.model.lora_hash_roots.extend(0xABC for _ in loras)
        registry.register(FakeEngineClient(smollm2_tokenizer, fake_tokens, info))
    assert registry.adapters() == {"sql": "fake-model"}
    router = Router(registry, "round_robin")
    prompt = list(range(3, 20))
    tuned = [router.route("fake-model", prompt, lora="sql") for _ in range(4)]
    assert {t.state.instance_id for t in tuned} == {"tuned-1", "tuned-2"}
    assert all(t.hashes == block_hashes(prompt, 4, parent=0xABC) != block_hashes(prompt, 4) for t in tuned)
    base = [router.route("fake-model", prompt) for _ in range(6)]
    assert {t.state.instance_id for t in base} == {"plain", "tuned-1", "tuned-2"}
    assert all(t.hashes == block_hashes(prompt, 4) for t in base)

    # kv_aware weighs residency (the instances' load reports) against load: the adapter is resident on tuned-2
    # only; tuned-1 would read it first (0.5 s measured), so tuned-2 takes it until tuned-2 is busier than that
    kv_aware = Router(registry, "kv_aware")
    registry.get("tuned-1").load = instance_pb2.LoadReport(lora_resident=["other"], lora_slots_free=1,
                                                           lora_load_seconds=0.5, prefill_tokens_per_s=1000)
    registry.get("tuned-2").load = instance_pb2.LoadReport(lora_resident=["sql"], lora_slots_free=0,
                                                           lora_load_seconds=0.5, prefill_tokens_per_s=1000)
    assert kv_aware.route("fake-model", prompt, lora="sql").state.instance_id == "tuned-2"
    registry.get("tuned-2").load.pending_prefill_tokens = 2000  # 2 s of queued prefill
    assert kv_aware.route("fake-model", prompt, lora="sql").state.instance_id == "tuned-1"
    registry.get("tuned-1").load.lora_slots_free = 0  # every slot of tuned-1 held by live requests: it would park
    assert kv_aware.route("fake-model", prompt, lora="sql").state.instance_id == "tuned-2"


def test_adapters_load_and_unload_at_run_time(served):
    """``POST /v1/load_lora_adapter`` makes a new adapter a model (answering as HF + PEFT does), ``/v1/unload_
    lora_adapter`` takes it away again; a bad directory is a 400 naming ``lora_path``."""
    client, base, _ = served
    extra = save_random_lora(base, base.parent / "extra", 4, 8, ["q_proj", "o_proj", "up_proj"], seed=21)
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(base.parent / "none")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    taken = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(extra)})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(extra)})
    assert r.status_code == 200 and r.json()["instances"] == ["engine-0"], r.text
    assert "extra" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    r = client.post("/v1/completions", json={"model": "extra", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
                                             "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == _hf_text(base, extra, base)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert "extra" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.post("/v1/completions", json={"model": "extra", "prompt": PROMPT}).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 404


def test_loading_is_all_or_none_and_needs_the_admin_key(smollm2_tokenizer, fake_tokens):
    """Two instances, one refusing the adapter: the other unloads it again and the refusal is the answer. With
    API keys, only an admin key may load (403 for a user key)."""
    from xllm.gateway.access import AccessPolicy
    from xllm.gateway.app import GatewayState, create_app
    from xllm.gateway.metrics import EngineMetrics
    from xllm.gateway.registry import EmbeddedRegistry
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.fakes import FAKE_MODEL, FakeEngineClient, make_info

    class Accepting(FakeEngineClient):
        async def load_lora(self, name: str, path: str) -> engine_pb2.LoadLoraResponse:
            self.lora_requests.append((name, path))
            return engine_pb2.LoadLoraResponse(ok=True, hash_root=77 if path else 0)

    registry = EmbeddedRegistry()
    yes = Accepting(smollm2_tokenizer, fake_tokens, make_info("yes"))
    no = FakeEngineClient(smollm2_tokenizer, fake_tokens, make_info("no"))
    registry.register(yes)
    registry.register(no)
    access = AccessPolicy(api_keys=frozenset({"sk-user"}), admin_keys=frozenset({"sk-admin"}))
    app = create_app(GatewayState(registry=registry, tokenizer=smollm2_tokenizer, metrics=EngineMetrics(),
                                  default_model=FAKE_MODEL, max_model_len=128, access=access))
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    with TestClient(app, raise_server_exceptions=False) as client:
        user = client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer sk-user"})
        assert user.status_code == 403 and yes.lora_requests == []
        r = client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 400 and "no LoRA adapters" in r.json()["error"]["message"]
        assert yes.lora_requests == [("sql", "/adapters/sql"), ("sql", "")]  # loaded, then unloaded again
        assert registry.adapters() == {}
        registry.deregister("no")
        r = client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 200 and registry.adapters() == {"sql": FAKE_MODEL}
        assert registry.get("yes").adapters() == {"sql": 77}


def test_an_instance_registering_later_is_given_the_run_time_adapters(smollm2_tokenizer, fake_tokens):
    """An adapter loaded at run time reaches an instance of its model that registers afterwards (and only once it
    has it, routed there); one whose files hash to another root is refused and unloaded there; an instance of
    another model is not asked; unloading reaches the late instance too."""
    from xllm.gateway.app import GatewayState, create_app
    from xllm.gateway.metrics import EngineMetrics
    from xllm.gateway.registry import EmbeddedRegistry
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.fakes import FAKE_MODEL, FakeEngineClient, make_info

    class Accepting(FakeEngineClient):
        def __init__(self, *args, root: int = 77) -> None:
            super().__init__(*args)
            self.root = root

        async def load_lora(self, name: str, path: str) -> engine_pb2.LoadLoraResponse:
            self.lora_requests.append((name, path))
            return engine_pb2.LoadLoraResponse(ok=True, hash_root=self.root if path else 0)

    registry = EmbeddedRegistry()
    first = Accepting(smollm2_tokenizer, fake_tokens, make_info("first"))
    registry.register(first)
    app = create_app(GatewayState(registry=registry, tokenizer=smollm2_tokenizer, metrics=EngineMetrics(),
                                  default_model=FAKE_MODEL, max_model_len=128))
    other_info = make_info("other-model")
    other_info.model.served_name = "another"
    late = Accepting(smollm2_tokenizer, fake_tokens, make_info("late"))
    stranger = Accepting(smollm2_tokenizer, fake_tokens, make_info("stranger"), root=99)
    other = Accepting(smollm2_tokenizer, fake_tokens, other_info)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert r.status_code == 200 and r.json()["instances"] == ["first"], r.text
        for joining in (late, stranger, other):
            client.portal.call(registry.register, joining)
        client.portal.call(registry.settled)
        assert late.lora_requests == [("sql", "/adapters/sql")]
        assert registry.get("late").adapters() == {"sql": 77}
        assert stranger.lora_requests == [("sql", "/adapters/sql"), ("sql", "")]  # other files: unloaded again
        assert registry.get("stranger").adapters() == {}
        assert other.lora_requests == []
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        assert late.lora_requests[-1] == ("sql", "") and first.lora_requests[-1] == ("sql", "")
        client.portal.call(registry.deregister, "late")
        client.portal.call(registry.register, late)  # registering again after the unload: nothing to give
        client.portal.call(registry.settled)
        assert late.lora_requests == [("sql", "/adapters/sql"), ("sql", "")]
        assert registry.adapters() == {}
