"""The model-backed proposers ``self`` (the target's first layers) and ``mtp`` (DeepSeek-V3's
next-token-prediction layer), and the chunked catch-up of every shadow drafter.

Oracles: greedy and seeded outputs identical with and without speculation (verification draws
every row as the sampler would: xllm.core.spec.verify); ``self`` over *all* of the target's layers
is the target itself, so every draft must be accepted (the view, its KV, catch-up and rollback agree
with the target); a chunked catch-up proposes exactly the drafts of an unchunked one; the MTP
target loaded with its MTP layer computes the same as without it (HF parity of the latter is
test_moe_mla_parity's)."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence
from xllm.core.spec.base import ProposerContext
from xllm.core.spec.selfspec import SelfProposer
from xllm.engine_api.errors import ConfigError
from xllm.models import load_model
from xllm.models.config import ModelConfigError
from xllm.testing.models import IdTokenizer, save_random_hf_model
from xllm.testing.reference import full_logits
from xllm.testing.spec import run_spec, save_tiny_deepseek_v3_mtp

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
SEEDED = dict(temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, vocab, (12,), generator=g).tolist()
    return [base * 3, torch.randint(0, vocab, (21,), generator=g).tolist(), [9]]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    """A random 3-layer model (Llama, or Qwen3 with q/k norms and an untied head)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        config = transformers.LlamaConfig(**COMMON, num_hidden_layers=3)
    else:
        config = transformers.Qwen3Config(**{**COMMON, "head_dim": 32}, num_hidden_layers=3, tie_word_embeddings=False)
    save_random_hf_model(path, config, seed=3, std=0.1)
    return load_model(path, torch.float32, progress=False)


@pytest.fixture(scope="module")
def plain(target):
    return run_spec(target, _prompts(300), 32), run_spec(target, _prompts(300), 32, sampling=SEEDED)


def test_self_greedy_and_seeded_identical(target, plain):
    greedy, seeded = plain
    got = run_spec(target, _prompts(300), 32, speculative="self", speculative_self_layers=1,
                   num_speculative_tokens=4)
    assert got.tokens == greedy.tokens
    assert got.num_draft_tokens > 0
    assert run_spec(target, _prompts(300), 32, sampling=SEEDED, speculative="self").tokens == seeded.tokens


def test_self_over_every_layer_accepts_every_draft(target, plain):
    """All layers: the view is the target, so every draft is the target's own greedy token."""
    got = run_spec(target, _prompts(300), 32, speculative="self", speculative_self_layers=3,
                   num_speculative_tokens=3)
    assert got.tokens == plain[0].tokens
    assert got.num_draft_tokens > 0 and got.num_accepted_tokens == got.num_draft_tokens


def test_self_view_shares_the_weights(target):
    view = target.layer_prefix(1)
    assert view.kv_cache_spec().num_layers == 1 and target.kv_cache_spec().num_layers == 3
    assert len(target.model.layers) == 3  # the view did not truncate the target
    assert view.model.layers[0] is target.model.layers[0] and view.model.norm is target.model.norm
    ours = {id(p) for p in view.parameters()}
    assert ours <= {id(p) for p in target.parameters()}


def _seq(prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=100, temperature=0), 0.0)
    seq.output_ids = list(output)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_chunked_catch_up_proposes_what_one_chunk_does(target):
    """Catch-up bounded at 5 tokens per proposal: no drafts until a shadow has caught up, then the
    drafts of an unchunked catch-up; sequences less behind are served first."""
    ctx = ProposerContext(EngineConfig(dtype=torch.float32, num_threads=1, max_model_len=256,
                                       speculative="self", speculative_self_layers=3), 256, torch.device("cpu"),
                          target=target)
    whole, chunked = SelfProposer(ctx), SelfProposer(ctx, catchup_tokens=5)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (23, 3)]
    seqs = [_seq(p, [7, 8]) for p in prompts]
    want = whole.propose([(s, 3) for s in seqs])
    assert all(len(d) == 3 for d in want)
    chunked_seqs = [_seq(p, [7, 8]) for p in prompts]
    rounds = []
    for _ in range(10):
        got = chunked.propose([(s, 3) for s in chunked_seqs])
        rounds.append(got)
        if got[0]:
            break
    assert rounds[0] == [[], want[1]]  # the short one caught up in the first 5-token chunk
    assert rounds[-1] == want and len(rounds) > 2
    assert all(r == [[], want[1]] for r in rounds[:-1])
    # and the greedy truth: the drafts of a full-depth view are the target's own greedy tokens
    ids = seqs[0].prompt_ids + seqs[0].output_ids
    for d in want[0]:
        assert full_logits(target, ids)[-1].argmax().item() == d
        ids = [*ids, d]
    whole.close()
    chunked.close()


def test_chunked_catch_up_in_the_engine(target, plain):
    cfg = dict(speculative="self", speculative_self_layers=3, num_speculative_tokens=3)
    engine = LLMEngine(target, IdTokenizer(), EngineConfig(dtype=torch.float32, num_threads=1, max_model_len=256,
                                                            max_num_batched_tokens=16, **cfg))
    assert engine.spec.proposer.catchup_tokens == 16  # the step's token budget
    engine.close()
    got = run_spec(target, _prompts(300), 32, max_num_batched_tokens=16, **cfg)
    assert got.tokens == plain[0].tokens and got.num_accepted_tokens == got.num_draft_tokens > 0


def test_invalid_values_name_the_flag(target):
    with pytest.raises(ConfigError, match="speculative_self_layers must be >= 1"):
        EngineConfig(speculative="self", speculative_self_layers=0)
    with pytest.raises(ConfigError, match="--speculative-self-layers"):
        EngineConfig(speculative="ngram", speculative_self_layers=2)
    with pytest.raises(ConfigError, match=r"--speculative-self-layers must be in 1\.\.3"):
        LLMEngine(target, IdTokenizer(), EngineConfig(dtype=torch.float32, num_threads=1, speculative="self",
                                                       speculative_self_layers=4))
    with pytest.raises(ConfigError, match="--speculative mtp"):
        LLMEngine(target, IdTokenizer(), EngineConfig(dtype=torch.float32, num_threads=1, speculative="mtp"))
    with pytest.raises(ConfigError, match="unknown speculative proposer 'medusa'"):
        EngineConfig(speculative="medusa")


def test_engine_flags_refuse_bad_values():
    import argparse

    from xllm.engine.config import engine_config
    from xllm.engine_api.flags import add_engine_process_arguments

    p = argparse.ArgumentParser()
    add_engine_process_arguments(p)
    for bad in (["--speculative", "nope"], ["--speculative", "self", "--speculative-self-layers", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    args = p.parse_args(["--speculative", "self", "--speculative-self-layers", "2", "--dtype", "float32"])
    assert engine_config(args).speculative_self_layers == 2


# ---- mtp on a tiny DeepSeek-V3 with one MTP layer ------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    """(the V3 loaded without its MTP layer, the same loaded with it)."""
    path = save_tiny_deepseek_v3_mtp(tmp_path_factory.mktemp("v3-mtp"))
    return load_model(path, torch.float32, progress=False), load_model(path, torch.float32, progress=False, mtp=True)


def test_mtp_loads_its_layer_and_leaves_the_target_alone(deepseek_mtp):
    plain, with_mtp = deepseek_mtp
    assert plain.mtp_layers() == [] and len(with_mtp.mtp_layers()) == 1
    ids = list(range(3, 40))
    assert torch.equal(full_logits(plain, ids), full_logits(with_mtp, ids))
    layer = with_mtp.mtp_layers()[0]
    assert layer.kv_cache_spec().num_layers == 1
    assert layer.module.block.self_attn.layer == 0  # KV layer 0 of the MTP's own cache


def test_mtp_greedy_and_seeded_identical(deepseek_mtp):
    plain, with_mtp = deepseek_mtp
    prompts = _prompts(499)
    greedy = run_spec(plain, prompts, 24)
    for sampling in (None, SEEDED):
        want = greedy if sampling is None else run_spec(plain, prompts, 24, sampling=sampling)
        got = run_spec(with_mtp, prompts, 24, sampling=sampling, speculative="mtp", num_speculative_tokens=3)
        assert got.tokens == want.tokens
        assert got.num_draft_tokens > 0
    # chunked prefill of the target and chunked catch-up of the MTP (8-token budget)
    assert run_spec(with_mtp, prompts, 24, speculative="mtp", max_num_batched_tokens=8).tokens == greedy.tokens


class _TargetStep:
    """What the target's model runner hands the MTP proposer: the chunks and positions of a forward."""

    def __init__(self, seq: Sequence, n: int) -> None:
        self.chunks = [(seq, n)]
        self.positions = torch.arange(n)


@torch.inference_mode()
def _mtp_reference(model, tokens: list[int], k: int) -> list[int]:
    """DeepSeek-V3's MTP by its definition, no cache: position i reads the token i + 1 (embedding zeroed at
    position 0) and the target's final hidden state h_i; h' = block(eh_proj([enorm(e), hnorm(h)])) (+ its
    residual); logits = shared_head.head(shared_head.norm(h')). Chained drafts read the layer's own h'."""
    from xllm.testing.reference import DenseContext

    m = model.mtp_layers()[0].module
    hidden = model.forward(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), DenseContext())
    ids, prev, drafts = list(tokens[1:]), [hidden[i] for i in range(len(tokens) - 1)], []
    for _ in range(k):
        pos = torch.arange(len(ids))
        embeds = model.model.embed_tokens(torch.tensor(ids))
        embeds[0] = 0
        x = m.eh_proj(torch.cat([m.enorm(embeds), m.hnorm(torch.stack(prev))], dim=-1))
        cos, sin = model.rotary.lookup(pos, x.dtype)
        out, residual = m.block(x, None, cos, sin, DenseContext())
        h = (out + residual)[-1]
        drafts.append(int(m.shared_head.head(m.shared_head.norm(h[None])).argmax()))
        ids.append(drafts[-1])
        prev.append(h)
    return drafts


def test_mtp_drafts_follow_the_definition(deepseek_mtp):
    """The proposer's drafts (target hidden states through the runner's hook, shadow shifted by one,
    catch-up KV, chaining on the layer's own output), whole and chunked, against the definition."""
    from xllm.core.spec.mtp import MTPProposer

    _, model = deepseek_mtp
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 499, (19,), generator=g).tolist()
    want = _mtp_reference(model, tokens, 3)
    ctx = ProposerContext(EngineConfig(dtype=torch.float32, num_threads=1, max_model_len=256, speculative="mtp"),
                          256, torch.device("cpu"), target=model)
    from xllm.testing.reference import DenseContext

    for chunk in (None, 4):
        proposer = MTPProposer(ctx, catchup_tokens=chunk)
        seq = _seq(tokens[:15], tokens[15:])
        with torch.inference_mode():
            hidden = model.forward(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), DenseContext())
        proposer.on_target_hidden(_TargetStep(seq, len(tokens) - 1), hidden)
        drafts = [proposer.propose([(seq, 3)])[0] for _ in range(5 if chunk else 1)]
        assert drafts[-1] == want, chunk
        if chunk:
            assert drafts[0] == []  # 18 positions behind, 4 per proposal
        proposer.close()


def test_self_on_deepseek(deepseek_mtp):
    """MLA + MoE: the first layer alone greedy-identical; both layers: every draft accepted."""
    plain, _ = deepseek_mtp
    prompts = _prompts(499)
    want = run_spec(plain, prompts, 16)
    assert run_spec(plain, prompts, 16, speculative="self").tokens == want.tokens
    full = run_spec(plain, prompts, 16, speculative="self", speculative_self_layers=2)
    assert full.tokens == want.tokens and full.num_accepted_tokens == full.num_draft_tokens > 0


def test_mtp_needs_an_mtp_checkpoint(target, tmp_path):
    config = transformers.LlamaConfig(**COMMON, num_hidden_layers=1)
    save_random_hf_model(tmp_path, config, seed=1)
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers"):
        load_model(tmp_path, torch.float32, progress=False, mtp=True)


@pytest.mark.real_model
def test_self_on_smollm2(smollm2_fp32, smollm2_tokenizer):
    """The bundled model (30 layers; the default draft: its first 7): greedy identical, short."""
    tok = smollm2_tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 20."}]),
               tok.encode("def fibonacci(n):\n    ")]
    want = run_spec(smollm2_fp32, prompts, 16, tokenizer=tok, max_model_len=512)
    got = run_spec(smollm2_fp32, prompts, 16, tokenizer=tok, max_model_len=512, speculative="self")
    assert got.tokens == want.tokens and got.num_draft_tokens > 0
