"""Weights in from Hugging Face / Meta folders and out to Hugging Face, against ``transformers`` itself.

A random ``LlamaForCausalLM`` of the debug flavor's shapes is saved with ``save_pretrained``
(several shards + index). It is loaded into one process, FSDP 2 (through ``torchrun train.py``),
TP 2 and PP 2 (one spawned world), and the step-1 loss / logits are compared with Hugging
Face's own forward on the same batch. The FSDP run trains at lr 0 and saves, so its checkpoint
holds the loaded weights: exporting it must give back the same tensors bitwise, and
``from_pretrained`` of the export must give the project's logits.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # a test-only dependency (the dev extra)
from conftest import DEBUG_CONFIG, REPO, SHIPPED_TOKENIZER, load_script, run_torchrun
from dist_harness import run_ranks
from helpers import hf_logits, hf_loss, reference_batch

from torchtitan.checkpoint.formats import check_source, export_hf, load_into, load_model
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import ffn_hidden_dim, llama3_flavors
from torchtitan.models.llama3.convert import args_with_fields, fields_from_hf_config

DEBUG_TOML = DEBUG_CONFIG
SEQ, BATCH = 32, 2
FLAVOR = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=2048)


def hf_config(args, **extra):
    return transformers.LlamaConfig(
        hidden_size=args.dim, intermediate_size=ffn_hidden_dim(args), num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, max_position_embeddings=2048,
        tie_word_embeddings=False, initializer_range=0.1, **extra)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random Hugging Face model of the debug flavor's shapes, in several safetensors shards."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config(FLAVOR))
    out = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(out, max_shard_size="1MB")
    assert (out / "model.safetensors.index.json").is_file()
    return out




def test_block_causal_logits_are_transformers_logits_with_packed_position_ids(hf_dir) -> None:
    """block_causal's positions, passed to transformers as ``position_ids``, give its packed-sequence logits."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, FLAVOR.vocab_size, (2, SEQ), generator=gen)
    positions = torch.tensor([[*range(SEQ // 4), *range(SEQ - SEQ // 4)], [*range(SEQ // 2), *range(SEQ // 2)]])
    model = Decoder(dataclasses.replace(FLAVOR, max_seq_len=SEQ, attn_mask_type="block_causal"))
    load_into(model, str(hf_dir), "hf", model.args)
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(tokens, positions=positions)
        # Without a KV cache: transformers reads packed documents from position_ids only in training-style calls.
        packed = theirs(tokens, position_ids=positions, use_cache=False).logits
        across = theirs(tokens).logits  # no position_ids: one causal sequence per row
    assert (ours - packed).abs().max().item() <= 1e-4
    assert (ours - across).abs().max().item() > 1e-2


def test_one_process_load_matches_hf_logits_with_and_without_rope_scaling(hf_dir, tmp_path) -> None:
    tokens = torch.randint(0, FLAVOR.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model = Decoder(dataclasses.replace(FLAVOR, max_seq_len=SEQ))
    assert load_into(model, str(hf_dir), "hf", model.args) == len(model.state_dict())
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(hf_dir, tokens)).abs().max().item()
    assert diff <= 1e-4, diff
    # Llama 3.2-style scaling (factor 32) read from config.json; original context 16 < SEQ so it bites.
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    torch.manual_seed(1)
    small = dataclasses.replace(FLAVOR, n_layers=2)
    scaled_dir = tmp_path / "scaled"
    transformers.LlamaForCausalLM(hf_config(small, rope_scaling=scaling)).save_pretrained(scaled_dir)
    fields = fields_from_hf_config(json.loads((scaled_dir / "config.json").read_text()))
    assert fields["rope_scaling"]["factor"] == 32.0
    args = args_with_fields(dataclasses.replace(small, max_seq_len=SEQ), fields)
    assert check_source(str(scaled_dir), "hf", args) == []
    assert check_source(str(scaled_dir), "hf", dataclasses.replace(args, rope_scaling=False))[0].endswith(
        "rope scaling (rope_scaling) is {'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
        "'original_context': 16.0} there, None in the configured model")
    model = Decoder(args)
    load_into(model, str(scaled_dir), "hf", args)
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(scaled_dir, tokens)).abs().max().item()
    assert diff <= 1e-4, diff


def test_meta_folder_loads_like_hf(hf_dir, tmp_path) -> None:
    """Meta's layout: our names, adjacent-pair rotary rows, two model-parallel shards joined on load."""
    args = dataclasses.replace(FLAVOR, max_seq_len=SEQ)
    ours = Decoder(args)
    load_into(ours, str(hf_dir), "hf", args)
    full = ours.state_dict()
    split = {"tok_embeddings": 0, "output": 0, "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    for part in range(2):
        shard = {}
        for fqn, t in full.items():
            dim = split.get(fqn.split(".")[-2])
            shard[fqn] = t if dim is None else t.chunk(2, dim=dim)[part].clone()
        torch.save(shard, meta_dir / f"consolidated.{part:02d}.pth")
    (meta_dir / "params.json").write_text(json.dumps({
        "dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 2048, "multiple_of": 256,
        "ffn_dim_multiplier": None, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": False}))
    assert check_source(str(meta_dir), "meta", args) == []
    loaded = Decoder(args)
    load_into(loaded, str(meta_dir), "meta", args)
    for fqn, t in loaded.state_dict().items():
        assert torch.equal(t, full[fqn]), fqn
    wrong = dataclasses.replace(args, n_layers=4, norm_eps=1e-6)
    problems = check_source(str(meta_dir), "meta", wrong)
    assert any("layers (n_layers) is 6 there, 4 in the configured model" in p for p in problems)
    assert any("norm eps (norm_eps) is 1e-05 there, 1e-06" in p for p in problems)


def test_bad_sources_are_config_errors_before_any_collective(hf_dir, tmp_path) -> None:
    import shutil

    from torchtitan.config import ConfigError, ConfigManager
    from torchtitan.preflight import preflight

    def problems(path: Path, *extra: str) -> str:
        cfg = ConfigManager().parse_args(["--job.config_file", DEBUG_TOML, f"--job.dump_folder={tmp_path / 'dump'}",
                                          f"--checkpoint.initial_load_path={path}", *extra])
        with pytest.raises(ConfigError) as e:
            preflight(cfg, world_size=2)
        return str(e.value)

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(hf_dir, dst)
        return dst

    # Shapes differ from the flavor: every differing field is named.
    wide = copy("wide")
    config = json.loads((wide / "config.json").read_text())
    config.update(hidden_size=512, num_key_value_heads=4, rms_norm_eps=1e-6, vocab_size=4096)
    (wide / "config.json").write_text(json.dumps(config))
    text = problems(wide)
    for field in ("model width (dim) is 512 there, 256", "key/value heads (n_kv_heads) is 4 there, 8",
                  "norm eps (norm_eps) is 1e-06 there, 1e-05", "vocabulary (vocab_size) is 4096 there, 2048"):
        assert field in text, text
    # A shard missing, a shard truncated, an index naming a file that is not there.
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    missing = copy("missing")
    (missing / first).unlink()
    assert f"names file(s) that are not there: {first}" in problems(missing)
    truncated = copy("truncated")
    data = (truncated / first).read_bytes()
    (truncated / first).write_bytes(data[: len(data) - 100])
    assert "is truncated: its tensors need" in problems(truncated)
    renamed = copy("renamed")
    index["weight_map"] = {k: v.replace(first, "model-99.safetensors") for k, v in index["weight_map"].items()}
    (renamed / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "names file(s) that are not there: model-99.safetensors" in problems(renamed)
    assert "no config.json there" in problems(tmp_path, "--checkpoint.initial_load_format=hf")
    # An unknown tokenizer format names all three.
    bad_tok = tmp_path / "tok.bin"
    bad_tok.write_bytes(b"\x00\x01garbage" * 50)
    text = problems(hf_dir, f"--model.tokenizer_path={bad_tok}")
    assert "SentencePiece" in text and "tiktoken" in text and "Hugging Face tokenizer.json" in text
    # Nothing was written or deleted.
    assert not (tmp_path / "dump").exists()
    assert sorted(p.name for p in hf_dir.iterdir()) == sorted(p.name for p in (tmp_path / "wide").iterdir())


def test_export_writes_a_sentencepiece_tokenizer_autotokenizer_reads(tmp_path, caplog, monkeypatch) -> None:
    """A run on the project's SentencePiece tokenizer exports it converted (tokenizer.json, tokenizer_config.json,
    and the .model beside them): transformers' AutoTokenizer encodes and decodes as the run did. Where transformers
    cannot convert it, the weights are still written and one warning line says why."""
    import random

    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import SpmConverter

    from torchtitan.models.llama3 import ModelArgs

    tok = build_tokenizer(SHIPPED_TOKENIZER)
    args = ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=tok.n_words, multiple_of=16, max_seq_len=64)
    files = export_hf(Decoder(args).state_dict(), args, tmp_path / "out", tokenizer=tok)
    assert {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} <= {f.name for f in files}
    theirs = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (tok.bos_id, tok.eos_id, tok.n_words)
    rng = random.Random(0)
    alphabet = "abcdefghij KLMNOP 0123456789.,;:!?\n\t'\"()[]{}/\\éß日🙂"
    texts = ["The cat sat on the mat.", "  spaced   out  ", "x = 42\n"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(40)]
    for text in texts:
        ids = tok.encode(text, bos=True, eos=False)
        assert theirs(text)["input_ids"] == ids, text  # BOS added, as the run's documents start
        assert theirs.decode(ids, skip_special_tokens=True) == tok.decode(ids), text
    # A transformers without the converter: the weights and the .model are written, and one line says why.
    monkeypatch.delattr(SpmConverter, "build_tokenizer_from_spm_proto")
    with caplog.at_level("WARNING", logger="torchtitan.checkpoint.formats"):
        files = export_hf(Decoder(args).state_dict(), args, tmp_path / "old", tokenizer=tok)
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    line = record.getMessage()
    assert "no tokenizer.json written" in line and "upgrade transformers" in line and "\n" not in line, line
    assert not (tmp_path / "old" / "tokenizer.json").exists() and (tmp_path / "old" / "tokenizer.model").is_file()


# ---------------------------------------------------------------- FP8 releases with a scale missing

FP8_BLOCK = 16  # a release's 128 x 128 blocks, scaled down to the tiny weights
FP8_DENSE, FP8_EXPERT = "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.1.down_proj.weight"


def _fp8_release(folder: Path, without_scale: str | None, quantization_config: bool = True) -> Path:
    """A tiny DeepSeek-V3 saved by transformers, its two weights ``FP8_DENSE`` and ``FP8_EXPERT`` stored as
    float8_e4m3fn codes with a ``_scale_inv`` each, as DeepSeek-V3's FP8 release is; ``without_scale``: the
    weight whose scale is left out."""
    from safetensors.torch import load_file, save_file

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, num_mtp_layers=0)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    for name in (FP8_DENSE, FP8_EXPERT):
        w = state[name]
        scale = w.abs().max() / 448.0  # one scale for every block: the codes span float8's range
        state[name] = (w / scale).to(torch.float8_e4m3fn)
        if name != without_scale:
            state[name + "_scale_inv"] = torch.full((-(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)), scale)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if quantization_config:
        hf = json.loads((folder / "config.json").read_text())
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK] * 2}
        (folder / "config.json").write_text(json.dumps(hf))
    return folder


@pytest.mark.parametrize("case", ["dense", "expert", "no_quantization_config"])
def test_float8_weights_without_their_scales_are_refused_in_one_line(tmp_path, case) -> None:
    """A float8 weight whose ``_scale_inv`` is missing (or whose release states no quantization) has no value:
    preflight, the load and generation each refuse it in one line naming the tensor, the scale (or the missing
    quantization_config) and the file."""
    from torchtitan.generation import describe
    from torchtitan.models import get_model_spec, model_args

    tensor = FP8_EXPERT if case == "expert" else FP8_DENSE
    folder = _fp8_release(tmp_path / "release", None if case == "no_quantization_config" else tensor,
                          quantization_config=case != "no_quantization_config")
    missing = "states no fp8 quantization_config" if case == "no_quantization_config" else f"{tensor}_scale_inv"
    args = model_args("deepseek_v3", str(folder))
    (problem,) = check_source(str(folder), "hf", args)
    assert tensor in problem and missing in problem and str(folder / "model.safetensors") in problem, problem
    assert "\n" not in problem
    with pytest.raises(ValueError) as e:  # the trainer's load, generation's and the export's (load_into)
        load_into(get_model_spec("deepseek_v3").build(args), str(folder), "hf", args)
    assert tensor in str(e.value) and missing in str(e.value)
    shutil.copyfile(SHIPPED_TOKENIZER, folder / "tokenizer.model")
    with pytest.raises(ValueError) as e:  # before generation reads any weight
        describe(folder)
    assert tensor in str(e.value) and missing in str(e.value)
    if case == "no_quantization_config":
        # with the quantization stated, the same folder loads: the scale, not the tensor, was missing
        _fp8_release(tmp_path / "stated", None)
        assert check_source(str(tmp_path / "stated"), "hf", args) == []


def _two_rank_layout_losses(rank: int, world_size: int, dump: str, hf: str) -> dict:
    """Several runs in one world: HF into TP 2, PP 2, CP 2 and DDP 2, DCP into PP 2, and the own checkpoint winning."""
    import logging

    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("torchtitan.checkpoint").addHandler(handler)
    logging.getLogger("torchtitan.checkpoint").setLevel(logging.INFO)

    def run(name: str, *overrides: str) -> list[float]:
        cfg = ConfigManager().parse_args([
            "--job.config_file", DEBUG_TOML, f"--job.dump_folder={dump}/{name}", "--job.print_args=false",
            "--metrics.enable_tensorboard=false", f"--training.seq_len={SEQ}", f"--training.batch_size={BATCH}",
            "--training.steps=1", "--lr_scheduler.warmup_steps=0",
            "--model.attn_mask_type=causal",  # transformers' loss attends across the packed documents
            *overrides])
        return Trainer(cfg).train()

    tp2, pp2 = ["--parallelism.tensor_parallel_degree=2"], ["--parallelism.pipeline_parallel_degree=2",
                                                            "--parallelism.pipeline_parallel_schedule=GPipe"]
    from_hf = [f"--checkpoint.initial_load_path={hf}"]
    out = {"tp2": run("tp2", *tp2, *from_hf, "--optimizer.lr=0", "--checkpoint.enable_checkpoint")[0],
           "pp2": run("pp2", *pp2, *from_hf)[0],
           "cp2": run("cp2", "--parallelism.context_parallel_degree=2", *from_hf)[0],
           "ddp2": run("ddp2", "--parallelism.data_parallel_replicate_degree=2",
                       "--parallelism.data_parallel_shard_degree=1", *from_hf)[0],
           # The TP run trained at lr 0, so its checkpoint holds the HF weights: PP 2 starts from it as DCP.
           "pp2_from_dcp": run("dcp", *pp2, f"--checkpoint.initial_load_path={dump}/tp2/checkpoint",
                               "--checkpoint.initial_load_format=dcp")[0]}
    # The TP run's own checkpoint wins over initial_load_path: it resumes after step 1.
    out["resumed_steps"] = len(run("tp2", *tp2, *from_hf, "--checkpoint.enable_checkpoint", "--training.steps=2"))
    out["messages"] = messages
    return out


@pytest.mark.slow
def test_loads_into_tp2_pp2_cp2_ddp2_give_hf_step1_loss(hf_dir, tmp_path) -> None:
    expected = hf_loss(hf_dir, BATCH)  # TP, PP and CP have one data-parallel rank: the global batch is BATCH
    results = run_ranks(_two_rank_layout_losses, 2, str(tmp_path), str(hf_dir), timeout=300)
    for name in ("tp2", "pp2", "pp2_from_dcp", "cp2", "ddp2"):
        assert results[0][name] == results[1][name]
        want = hf_loss(hf_dir, 2 * BATCH) if name == "ddp2" else expected
        assert results[0][name] == pytest.approx(want, rel=1e-5), name
    assert results[0]["resumed_steps"] == 1
    log = "\n".join(results[0]["messages"])
    # TP, CP (FSDP over cp) and DDP: every rank reads all 57 tensors (a slice, a shard, a replica);
    # PP: rank 0 holds the embedding and layers 0-2 only.
    assert log.count("loaded 57 tensors from") == 3 and log.count("loaded 28 tensors from") == 2, log
    assert "holds this run's own checkpoint, which wins: --checkpoint.initial_load_path=" in log


def _export_script():
    """scripts/export_checkpoint.py as a module (called in-process: no second interpreter start)."""
    return load_script("scripts/export_checkpoint.py")


@pytest.mark.slow
def test_torchrun_fsdp2_from_hf_then_export_round_trip(hf_dir, tmp_path, capsys) -> None:
    """train.py under torchrun: FSDP 2 starts from the HF folder (loss = HF's), saves, exports back bitwise."""
    from safetensors.torch import load_file

    dump = tmp_path / "dump"
    out = run_torchrun(
        REPO / "train.py", "--job.config_file", DEBUG_TOML, f"--job.dump_folder={dump}",
        "--metrics.enable_tensorboard=false",
        "--model.attn_mask_type=causal",  # transformers' loss attends across the packed documents
        f"--training.seq_len={SEQ}", f"--training.batch_size={BATCH // 2}", "--training.steps=1",
        "--parallelism.data_parallel_shard_degree=2", "--optimizer.lr=0", "--lr_scheduler.warmup_steps=0",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.model_weights_only", f"--checkpoint.initial_load_path={hf_dir}",
        "--checkpoint.initial_load_format=hf", timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded 57 tensors from" in out.stderr
    loss = float(re.search(r"step: 1 +loss: ([0-9.]+)", out.stderr).group(1))
    assert loss == pytest.approx(hf_loss(hf_dir, BATCH), abs=1e-4)  # the log prints 5 significant digits

    # Export: a non-empty target is refused and left alone, then a fresh folder gets the model.
    export = _export_script().main
    checkpoint = str(dump / "checkpoint" / "step-1")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert export([checkpoint, str(busy), "--format", "hf"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    exported = tmp_path / "exported"
    assert export([checkpoint, str(exported), "--format", "hf", "--max_shard_gib=0.001"]) == 0
    # The tokenizer is the shipped SentencePiece one, converted for AutoTokenizer; config.json names its BOS/EOS.
    config = json.loads((exported / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["architectures"]) == (1, 2, ["LlamaForCausalLM"])
    assert transformers.AutoTokenizer.from_pretrained(exported)("Hello world")["input_ids"] == build_tokenizer(
        SHIPPED_TOKENIZER).encode("Hello world", bos=True, eos=False)
    original = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    back = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    assert len(list(exported.glob("*.safetensors"))) > 1
    assert back.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(back[name], t) and back[name].dtype == t.dtype, name
    # from_pretrained reads it, and its logits are the project's model's (read as generation reads it).
    args = dataclasses.replace(FLAVOR, max_seq_len=SEQ)
    ours = load_model(dump / "checkpoint" / "step-1", "dcp", args, device=torch.device("cpu"))
    tokens, _ = reference_batch(BATCH)
    with torch.no_grad():
        diff = (ours(tokens) - hf_logits(exported, tokens)).abs().max().item()
    print(f"debug model: max |logits(project) - logits(HF export)| = {diff:.3g}")
    assert diff <= 1e-4, diff


@pytest.mark.slow  # starts no process, but takes about 20 s: out of the fast tier
def test_8b_shaped_export_matches_transformers(tmp_path) -> None:
    """8B dimensions (GQA 32/8, FFN 14336, 3.1 rope scaling), 2 layers and a 256-word vocabulary: one process."""
    args = dataclasses.replace(llama3_flavors["8B"], n_layers=2, vocab_size=256)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    with torch.no_grad():  # about the init's scales, drawn untruncated (init_weights takes 4x longer here)
        for fqn, p in model.named_parameters():
            if "norm" in fqn:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 1.0 if "tok_embeddings" in fqn else args.dim**-0.5 if fqn == "output.weight" else 0.02)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    export_hf(model.state_dict(), args, tmp_path / "hf8b")
    del model
    theirs = hf_logits(tmp_path / "hf8b", tokens)
    diff = (ours - theirs).abs().max().item()
    print(f"8B-shaped: max |logits(project) - logits(HF export)| = {diff:.3g} (logits max {ours.abs().max():.3g})")
    assert diff <= 1e-4, diff
