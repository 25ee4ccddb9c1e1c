"""Attention backends (models/attention/backends.py): chosen in one place, each with stated capabilities that
preflight compares with the model's needs; a run through the launcher refuses a backend that lacks one.

- ``select_backend`` gives each backend for the mask, device and context parallelism it is asked for;
- ``backend_problems`` names each missing capability in one line (and nothing when the backend fits), and every
  capability field differs between two backends (a field equal on all would be a check that never fires);
- decoding goes through the backend the attention is handed, MLA's and GPT-OSS's included; a training backend
  refuses a cache in one line, and ``decoding_backend`` keeps the run's CPU kernels;
- the backend a model is given decides its kernels: ``sdpa`` refuses a document mask at run time, and the
  ``document_sdpa`` and ``sdpa`` backends give the same output on a causal forward;
- the KV cache sizes keys and values apart (a value head size other than the key's, as MLA has);
- through ``run_llama_train.sh``, ``--model.attention_backend=sdpa`` with the block_causal mask exits 2 before
  any rank starts, with the one line naming the gap and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from conftest import CI_CONFIG, REPO

from torchtitan.models import get_model_spec, model_args
from torchtitan.models.attention import (
    BACKENDS,
    NO_EXTRAS,
    AttentionNeeds,
    Capabilities,
    DocumentSDPA,
    FlexDocument,
    KVCacheDecode,
    ScoreExtras,
    SDPACausal,
    backend_problems,
    decoding_backend,
    describe_backend,
    select_backend,
)
from torchtitan.models.attention.backends import has_score_extras
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.kv_cache import KVCache
from torchtitan.models.llama3 import llama3_flavors

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, max_seq_len=32, vocab_size=64)
GQA = AttentionNeeds(mask="block_causal")


@pytest.mark.parametrize("choice,mask,device,expected", [
    ("auto", "block_causal", "cpu", DocumentSDPA),
    ("auto", "block_causal", "cuda", FlexDocument),
    ("auto", "causal", "cpu", SDPACausal),
    ("auto", "causal", "cuda", SDPACausal),
    ("sdpa", "causal", "cpu", SDPACausal),
    ("document_sdpa", "causal", "cuda", DocumentSDPA),
])
def test_select_backend_is_the_one_choice(choice, mask, device, expected):
    backend = select_backend(choice, mask, device, cpu_kernels=device == "cpu")
    assert type(backend) is expected and backend.cpu_kernels == (device == "cpu")
    assert select_backend(choice, mask, device, cpu_kernels=device == "cpu") is backend  # one object per choice


def test_sinks_and_windows_say_which_kernel_runs_once_at_start_up():
    """GPT-OSS's sinks take FlexAttention on CUDA; elsewhere the start-up line says it is skipped and why."""
    assert has_score_extras(_meta("gpt_oss", "debugmodel")) and not has_score_extras(_meta("llama3", "debugmodel"))
    line = describe_backend
    assert line("auto", "causal", "cpu", compiled=False, context_parallel=False, score_extras=True) == (
        "attention mask: causal (across documents); kernel for the sinks and sliding windows: FlexAttention skipped, "
        "no CUDA device (the explicit scores with the sink column run)")
    assert line("auto", "block_causal", "cuda", compiled=False, context_parallel=False, score_extras=True) == (
        "attention mask: block_causal (documents from the data's positions); kernel for the sinks and sliding "
        "windows: FlexAttention with a block mask, rescaled by the sinks")
    assert line("auto", "causal", "cuda", compiled=False, context_parallel=True, score_extras=True).endswith(
        "FlexAttention skipped under context parallelism (the explicit scores with the sink column run, per chunk)")
    # Without sinks the line names the backend's own kernel, as before.
    assert line("auto", "causal", "cpu", compiled=False, context_parallel=False).endswith("kernel: causal SDPA")


def _meta(name: str, flavor: str) -> torch.nn.Module:
    with torch.device("meta"):
        return get_model_spec(name).build(model_args(name, flavor))


def test_backend_problems_name_each_missing_capability_in_one_line():
    assert backend_problems("auto", GQA, "cpu", context_parallel=False) == []
    assert backend_problems("auto", GQA, "cpu", context_parallel=True) == []  # the context_parallel backend
    assert backend_problems("document_sdpa", GQA, "cuda", context_parallel=False) == []
    assert backend_problems("sdpa", GQA, "cpu", context_parallel=False) == [
        "--model.attention_backend=sdpa: the sdpa attention backend does not apply the block_causal mask "
        "(--model.attn_mask_type); use --model.attention_backend=auto"]
    problems = backend_problems("flex", GQA, "cpu", context_parallel=True)
    assert len(problems) == 2 and "context parallelism" in problems[0] and "cpu devices" in problems[1]


def test_every_capability_field_tells_two_backends_apart():
    for field in dataclasses.fields(Capabilities):
        values = {repr(getattr(backend.capabilities, field.name)) for backend in BACKENDS.values()}
        assert len(values) > 1, f"Capabilities.{field.name} is {values.pop()} on every backend"


def test_a_backend_refuses_at_run_time_what_it_lacks():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="causal mask only"):
        model = Decoder(ARGS)
        model.use_attention_backend(SDPACausal())
        model(torch.zeros(1, 8, dtype=torch.long), positions=torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="^the document_sdpa attention backend does not decode against a KV cache"):
        DocumentSDPA().attend_cached(q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    assert type(decoding_backend(SDPACausal())) is KVCacheDecode
    decode = decoding_backend(DocumentSDPA(cpu_kernels=True))
    assert type(decode) is KVCacheDecode and decode.cpu_kernels


class CountingDecode(KVCacheDecode):
    """The kv_cache backend, counting the layers that decode through it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        self.calls += 1
        return super().attend_cached(q, k, v, mask, extras)


@pytest.mark.parametrize("family", ["llama3", "gpt_oss", "deepseek_v3"])  # GQA, sinks with windows, MLA
def test_decoding_goes_through_the_backend_the_attention_is_handed(family):
    args = dataclasses.replace(model_args(family, "debugmodel"), vocab_size=64, max_seq_len=32)
    torch.manual_seed(0)
    model = get_model_spec(family).build(args)
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, 64, (2, 6))
    outs = []
    for backend in (None, CountingDecode()):
        if backend is not None:
            model.use_attention_backend(backend)
        cache = KVCache(torch.zeros(2, dtype=torch.long), capacity=8)
        with torch.no_grad():
            outs.append(torch.cat([model(tokens[:, :4], cache=cache), model(tokens[:, 4:], cache=cache)], dim=1))
    assert backend is not None and backend.calls == 2 * args.n_layers  # two forwards, every layer
    assert torch.equal(outs[0], outs[1])


def test_the_models_backend_decides_its_kernels():
    torch.manual_seed(0)
    model = Decoder(ARGS)
    model.init_weights()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    outs = []
    for backend in (SDPACausal(), DocumentSDPA(cpu_kernels=True)):
        model.use_attention_backend(backend)
        outs.append(model(tokens))  # no positions: causal over the whole window
    assert torch.equal(outs[0], outs[1])


def test_the_kv_cache_sizes_values_apart_from_keys():
    cache = KVCache(torch.zeros(2, dtype=torch.long), capacity=6)
    cache.begin(3)
    k, v = cache.layer("0").update(torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 8))
    assert k.shape == (2, 1, 3, 16) and v.shape == (2, 1, 3, 8)
    layer = cache.layer("0")
    assert layer.k is not None and layer.v is not None
    assert layer.k.shape == (2, 1, 6, 16) and layer.v.shape == (2, 1, 6, 8)


@pytest.mark.slow
def test_the_launcher_refuses_a_backend_that_lacks_the_mask(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "1", "CONFIG_FILE": CI_CONFIG,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(["bash", str(REPO / "run_llama_train.sh"), "--model.attention_backend=sdpa",
                          f"--job.dump_folder={tmp_path / 'dump'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert ("--model.attention_backend=sdpa: the sdpa attention backend does not apply the block_causal mask "
            "(--model.attn_mask_type); use --model.attention_backend=auto") in text, text[-3000:]
    assert "torch.distributed.run" not in text and "Training" not in text  # refused before any rank started
