"""Generation on one process: greedy equals transformers' ``generate`` token for token (CPU, fp32), the KV
cache equals a full recompute, sampling and stopping, and bad input refused in one line each.

The model is a tiny random Llama 3 written as a Hugging Face folder by the project's export
(``checkpoint/formats.export_hf``) and as a Meta release; both are read by ``scripts/generate.py``.
Qwen3, Qwen3-MoE and Mixtral (the shared decoder's families) are tiny random ``transformers`` models.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import REPO, SHIPPED_TOKENIZER

from torchtitan.checkpoint.formats import export_hf
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.generation import Sampling, decode, describe, filter_logits, generate, load
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import llama3_flavors

PROMPTS = ["Once upon a time", "The cat sat on the mat and then it looked at", "Hi"]
NEW = 24
TINY = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           vocab_size=2048, max_seq_len=96)
VARIANTS = {"untied": TINY, "tied_scaled_rope": dataclasses.replace(
    TINY, tie_word_embeddings=True, rope_scaling=True, rope_scaling_factor=8.0, rope_original_max_seq_len=32)}


def _script():
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_model(args, seed: int = 0) -> Decoder:
    """A random model whose attention matters: the init's small projections (std 0.02) leave the logits
    to the embedding alone, and a wrong mask or position would not change a greedy token."""
    torch.manual_seed(seed)
    model = Decoder(args)
    model.init_weights()
    with torch.no_grad():
        for layer in model.layers.values():
            for p in layer.attention.parameters():
                p.mul_(10.0)
    return model


def write_hf(folder: Path, args, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """A random model of ``args`` exported as a Hugging Face folder (fp32) with the shipped SentencePiece tokenizer,
    which the export converts to tokenizer.json (generation reads that); without it when ``with_tokenizer`` is
    False."""
    model = random_model(args, seed)
    export_hf({k: v.detach() for k, v in model.state_dict().items()}, args, folder,
              tokenizer=build_tokenizer(SHIPPED_TOKENIZER) if with_tokenizer else None, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generation")
    return {name: write_hf(root / name, args, seed) for seed, (name, args) in enumerate(VARIANTS.items())}


def hf_greedy(folder: Path, prompt_tokens: list[list[int]], new: int,
              cls: type = transformers.LlamaForCausalLM) -> list[list[int]]:
    """transformers' greedy ``generate`` of the left-padded batch."""
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    longest = max(len(p) for p in prompt_tokens)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompt_tokens])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_tokens])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=0, eos_token_id=None)
    return out[:, longest:].tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_transformers_generate_with_and_without_the_cache(hf_dirs, variant) -> None:
    folder = hf_dirs[variant]
    loaded = load(describe(folder), device=torch.device("cpu"))
    assert loaded.fmt == "hf" and loaded.args.tie_word_embeddings == VARIANTS[variant].tie_word_embeddings
    # No end token, so that every row runs the whole length (the comparison is over NEW tokens).
    cached = decode(loaded.model, [loaded.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS], NEW,
                    Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len)
    full = decode(loaded.model, [loaded.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS], NEW,
                  Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len, use_cache=False)
    prompt_tokens = [loaded.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    assert len({len(p) for p in prompt_tokens}) == 3  # three lengths: the batch is padded
    assert cached.tokens == full.tokens
    assert cached.tokens == hf_greedy(folder, prompt_tokens, NEW)
    # Each prompt alone gives what it gives in the batch: the padding is invisible.
    for prompt, tokens in zip(prompt_tokens, cached.tokens):
        alone = decode(loaded.model, [prompt], NEW, Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len)
        assert alone.tokens == [tokens]


def test_meta_release_generates_what_the_hf_folder_does(hf_dirs, tmp_path) -> None:
    """Meta's layout (params.json + consolidated.00.pth, its tokenizer.model) gives the same greedy text."""
    hf = load(describe(hf_dirs["untied"]), device=torch.device("cpu"))
    meta = tmp_path / "meta"
    meta.mkdir()
    torch.save(dict(hf.model.state_dict()), meta / "consolidated.00.pth")
    a = TINY
    (meta / "params.json").write_text(json.dumps({
        "dim": a.dim, "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
        "vocab_size": a.vocab_size, "multiple_of": a.multiple_of, "ffn_dim_multiplier": None, "norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta, "use_scaled_rope": False, "tie_word_embeddings": False}))
    shutil.copyfile(SHIPPED_TOKENIZER, meta / "tokenizer.model")
    source = describe(meta)
    assert source.fmt == "meta"
    ours = load(source, device=torch.device("cpu"))
    expected, _ = generate(hf, PROMPTS, 8, Sampling())
    got, _ = generate(ours, PROMPTS, 8, Sampling())
    assert [o.tokens for o in got] == [o.tokens for o in expected]


def test_sampling_is_seeded_and_its_filters_keep_what_they_say() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = logits.softmax(-1)[0]  # about 0.61, 0.22, 0.14, 0.03
    kept = lambda **kw: (filter_logits(logits, **kw) > float("-inf")).sum().item()  # noqa: E731
    assert kept(top_k=2, top_p=1.0) == 2 and kept(top_k=None, top_p=1.0) == 4
    assert kept(top_k=None, top_p=float(probs[0]) - 1e-3) == 1
    assert kept(top_k=None, top_p=float(probs[0]) + 1e-3) == 2
    assert kept(top_k=None, top_p=float(probs[:3].sum()) + 1e-3) == 4
    assert kept(top_k=3, top_p=float(probs[:2].sum()) - 1e-3) == 2

    model = random_model(TINY)
    prompts = [[1, 5, 9, 200], [1, 7]]

    def run(sampling: Sampling) -> list[list[int]]:
        return decode(model, prompts, 12, sampling, stop_ids=[], max_len=TINY.max_seq_len).tokens

    greedy = run(Sampling())
    assert run(Sampling(temperature=1.0, top_k=1, seed=3)) == greedy
    assert run(Sampling(temperature=1.0, top_p=1e-6, seed=3)) == greedy
    hot = Sampling(temperature=5.0, seed=3)
    assert run(hot) == run(hot)
    assert run(hot) != run(dataclasses.replace(hot, seed=4)) and run(hot) != greedy
    # The cache does not change what is sampled either.
    assert decode(model, prompts, 12, hot, stop_ids=[], max_len=TINY.max_seq_len, use_cache=False).tokens == run(hot)


def test_a_row_stops_at_an_end_token_and_the_batch_when_all_have() -> None:
    model = random_model(TINY)
    prompts = [[1, 5, 9, 200], [1, 7]]
    free = decode(model, prompts, 10, Sampling(), stop_ids=[], max_len=TINY.max_seq_len)
    stop = free.tokens[0][2]
    assert stop not in free.tokens[1]
    ended = decode(model, prompts, 10, Sampling(), stop_ids=[stop], max_len=TINY.max_seq_len)
    assert ended.tokens == [free.tokens[0][:3], free.tokens[1]] and ended.finished == [True, False]
    both = decode(model, prompts, 10, Sampling(), stop_ids=[stop, free.tokens[1][4]], max_len=TINY.max_seq_len)
    assert both.tokens == [free.tokens[0][:3], free.tokens[1][:5]] and both.finished == [True, True]
    # The longest sequence the model takes ends every row.
    short = decode(model, prompts, 100, Sampling(), stop_ids=[], max_len=8)
    assert [len(t) for t in short.tokens] == [4, 4]


def test_script_prints_text_and_json(hf_dirs, tmp_path, capsys) -> None:
    main = _script().main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\n\nThe cat sat\n")
    assert main([str(hf_dirs["untied"]), "--prompt", PROMPTS[0], "--prompts_file", str(prompts),
                 "--max_new_tokens", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    tok = build_tokenizer(SHIPPED_TOKENIZER)
    outs = result["outputs"]
    assert [o["prompt"] for o in outs] == [PROMPTS[0], "Hi", "The cat sat"]
    assert [o["prompt_tokens"] for o in outs] == [tok.encode(p, bos=True, eos=False) for p in
                                                  (PROMPTS[0], "Hi", "The cat sat")]
    assert all(1 <= len(o["tokens"]) <= 5 and o["text"] == tok.decode(o["tokens"]) for o in outs)
    assert result["timing"]["tokens_per_s"] > 0 and result["kv_cache"] is True
    assert main([str(hf_dirs["untied"]), "--prompt", "Hi", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out == "Hi" + outs[1]["text"] + "\n"


def test_bad_input_is_one_line_each(hf_dirs, tmp_path, capsys) -> None:
    main = _script().main

    def refused(*argv: str) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        return err

    folder = str(hf_dirs["untied"])
    (tmp_path / "empty").mkdir()
    assert "neither a checkpoint of this project" in refused(str(tmp_path / "empty"), "--prompt", "x")
    assert "no such folder" in refused(str(tmp_path / "nowhere"), "--prompt", "x")
    long = " ".join(["word"] * 200)
    assert "not shorter than the model's max_seq_len (96)" in refused(folder, "--prompt", "ok", "--prompt", long)
    for top_p in ("0", "1.5", "-0.1"):
        assert f"--top_p={float(top_p)}: must lie in (0, 1]" in refused(folder, "--prompt", "x", "--top_p", top_p)
    small = write_hf(tmp_path / "small_vocab", dataclasses.replace(TINY, vocab_size=1024))
    assert "has 2048 tokens, more than the vocabulary" in refused(str(small), "--prompt", "x")
    bare = write_hf(tmp_path / "bare", TINY, with_tokenizer=False)
    assert "holds no tokenizer" in refused(str(bare), "--prompt", "x")
    assert "no prompt given" in refused(folder)


def test_training_forward_is_unchanged_by_the_cache_path() -> None:
    """A forward without a cache is the plain causal forward; with one, the prefill's logits are the same."""
    torch.manual_seed(0)
    model = Decoder(dataclasses.replace(TINY, attn_mask_type="causal"))
    model.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    from torchtitan.models.kv_cache import KVCache

    plain = model(tokens)
    cached = model(tokens, cache=KVCache(torch.zeros(2, dtype=torch.long), 16))
    torch.testing.assert_close(cached, plain, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the shared decoder: Qwen3, Qwen3-MoE, Mixtral


def _decoder_configs() -> dict[str, tuple[type, object]]:
    """transformers' model and a tiny config of each family on ``Decoder`` (the shipped tokenizer's vocabulary)."""
    small = dict(vocab_size=TINY.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=TINY.max_seq_len)
    return {
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            intermediate_size=48, head_dim=16, tie_word_embeddings=True, **small)),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, head_dim=16, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[0], norm_topk_prob=True, **small)),
        "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **small)),
        # Sinks, biases, a window (5) shorter than every row, YaRN, the clamped experts.
        "gpt_oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig(
            intermediate_size=16, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
            swiglu_limit=1.0, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
            **{k: v for k, v in small.items() if k != "rope_theta"})),
    }


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_decoder_families_greedy_equals_transformers_generate(case, tmp_path) -> None:
    """The KV cache lives in the shared attention and decoder: Qwen3 (query/key norms, head_dim apart from dim),
    Qwen3-MoE (a dense layer, then experts), Mixtral and GPT-OSS (sinks and a sliding window over the cache)
    decode as transformers does, with and without it."""
    cls, config = _decoder_configs()[case]
    torch.manual_seed(0)
    theirs = cls(config).float().eval()
    with torch.no_grad():  # attention (and the norms) must matter to the greedy tokens, as in random_model
        for name, p in theirs.named_parameters():
            if name.endswith(("sinks", "bias")):  # GPT-OSS initialises them to zero: make them matter
                p.copy_(torch.randn_like(p))
            elif ".self_attn." in name and not name.endswith("norm.weight"):
                p.mul_(10.0)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path)
    shutil.copyfile(SHIPPED_TOKENIZER, tmp_path / "tokenizer.model")
    source = describe(tmp_path)
    assert source.spec.name == {"mixtral": "mixtral", "gpt_oss": "gpt_oss"}.get(case, "qwen3")
    assert source.args.num_experts == (0 if case == "qwen3" else config.num_local_experts)
    loaded = load(source, device=torch.device("cpu"))
    prompt_tokens = [loaded.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    cached = decode(loaded.model, prompt_tokens, NEW, Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len)
    full = decode(loaded.model, prompt_tokens, NEW, Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len,
                  use_cache=False)
    assert cached.tokens == full.tokens
    assert cached.tokens == hf_greedy(tmp_path, prompt_tokens, NEW, cls)
    assert len({tuple(t) for t in cached.tokens}) == 3  # rows differ: the prompts (and the padding) reach them


def test_deepseek_v3_greedy_equals_transformers_generate(tmp_path, capsys) -> None:
    """MLA's cache (the latent and the shared rotary key) decodes as transformers' DeepseekV3ForCausalLM
    generates: query LoRA, YaRN, a dense layer then experts with a shared one, left-padded rows. The release's
    routing bias (``e_score_correction_bias``, never zero in DeepSeek-V3's) is loaded, not reset after the load,
    and ``scripts/generate.py`` gives transformers' greedy tokens."""
    config = transformers.DeepseekV3Config(
        vocab_size=TINY.vocab_size, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=TINY.max_seq_len, num_mtp_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 24})
    torch.manual_seed(0)
    theirs = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if ".self_attn." in name and "layernorm" not in name:
                p.mul_(10.0)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        bias = theirs.model.layers[1].mlp.gate.e_score_correction_bias  # a buffer, zero at init
        bias.copy_(torch.randn_like(bias))
    theirs.save_pretrained(tmp_path)
    shutil.copyfile(SHIPPED_TOKENIZER, tmp_path / "tokenizer.model")
    source = describe(tmp_path)
    assert source.spec.name == "deepseek_v3"
    loaded = load(source, device=torch.device("cpu"))
    assert torch.equal(loaded.model.layers["1"].feed_forward.router.expert_bias, bias)
    prompt_tokens = [loaded.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    cached = decode(loaded.model, prompt_tokens, NEW, Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len)
    full = decode(loaded.model, prompt_tokens, NEW, Sampling(), stop_ids=[], max_len=loaded.args.max_seq_len,
                  use_cache=False)
    assert cached.tokens == full.tokens
    expected = hf_greedy(tmp_path, prompt_tokens, NEW, transformers.DeepseekV3ForCausalLM)
    assert cached.tokens == expected
    assert len({tuple(t) for t in cached.tokens}) == 3
    # The script: its rows stop at the end token, so each is the start of transformers' row.
    assert _script().main([str(tmp_path), *[a for p in PROMPTS for a in ("--prompt", p)], "--max_new_tokens",
                           str(NEW), "--json"]) == 0
    rows = [o["tokens"] for o in json.loads(capsys.readouterr().out)["outputs"]]
    assert all(row == want[:len(row)] and (len(row) == NEW or row[-1] == loaded.tokenizer.eos_id)
               for row, want in zip(rows, expected)), (rows, expected)
