import copy
import dataclasses
import math

import pytest
import torch

from torchtitan.distributed.init_spec import InitSpec, apply_init_spec
from torchtitan.models.attention import SDPACausal
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.flops import flops_per_token
from torchtitan.models.layers import apply_rotary_emb, precompute_rope_cache
from torchtitan.models.llama3 import ModelArgs, llama3_flavors

# Keep the rope cache small; everything else is the debug flavor (GQA: 16 q heads, 8 kv heads).
DEBUG = dataclasses.replace(llama3_flavors["debugmodel"], max_seq_len=64)


def make_model(args: ModelArgs = DEBUG, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(args)
    model.init_weights()
    return model


def tokens(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, DEBUG.vocab_size, (batch, seqlen), generator=g)


def test_output_shape_and_gqa():
    model = make_model()
    assert DEBUG.n_kv_heads < DEBUG.n_heads
    assert model.layers["0"].attention.wk.weight.shape == (DEBUG.n_kv_heads * DEBUG.head_dim, DEBUG.dim)
    with torch.no_grad():
        logits = model(tokens(2, 12))
    assert logits.shape == (2, 12, DEBUG.vocab_size)
    assert torch.isfinite(logits).all()


def test_attention_matches_naive_reference():
    args = dataclasses.replace(DEBUG, n_heads=8, n_kv_heads=2)
    torch.manual_seed(0)
    attn = args.attention().build()
    bs, seqlen, hd = 2, 7, args.head_dim
    x = torch.randn(bs, seqlen, args.dim)
    rope = precompute_rope_cache(hd, seqlen, args.rope_theta)
    with torch.no_grad():
        out = attn(x, rope, backend=SDPACausal())
        q = attn.wq(x).view(bs, seqlen, 8, hd)
        k = attn.wk(x).view(bs, seqlen, 2, hd)
        v = attn.wv(x).view(bs, seqlen, 2, hd)
        q, k = apply_rotary_emb(q, k, rope)
        k, v = k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2)  # q head h uses kv head h // 4
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        ref = attn.wo(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(bs, seqlen, -1))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_causal_masking():
    model = make_model()
    t = 5
    a = tokens(1, 10)
    b = a.clone()
    b[0, t] = (a[0, t] + 1) % DEBUG.vocab_size
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :t], lb[:, :t], atol=0, rtol=0)
    assert not torch.allclose(la[:, t], lb[:, t])


def reference_freqs(head_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """Llama 3.1 frequency rule written out per frequency in float64 Python math."""
    out = []
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        if scaling:
            factor, low, high, ctx = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                          "original_context"))
            wavelen = 2 * math.pi / f
            if wavelen < ctx / high:  # high frequencies: untouched
                pass
            elif wavelen > ctx / low:  # low frequencies: divided by the factor
                f = f / factor
            else:  # in between: linear blend in ctx / wavelen
                s = (ctx / wavelen - low) / (high - low)
                f = (1 - s) * f / factor + s * f
        out.append(f)
    return out


# Llama 3.1 (factor 8) and Llama 3.2 1B/3B (factor 32), as the flavors carry them.
SCALINGS = {"none": None, "3.1": llama3_flavors["8B"].rope_scaling_params(),
            "3.2": llama3_flavors["1B"].rope_scaling_params()}


def test_flavors_carry_the_published_rope_scaling():
    assert SCALINGS["3.1"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_context": 8192}
    assert SCALINGS["3.2"] == {**SCALINGS["3.1"], "factor": 32.0}
    assert llama3_flavors["debugmodel"].rope_scaling_params() is None


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rope_matches_direct_formula(scaling):
    head_dim, theta = 128, 500000.0
    params = SCALINGS[scaling]
    freqs = reference_freqs(head_dim, theta, params)
    if params:  # make sure all three bands of the rule are exercised
        plain = reference_freqs(head_dim, theta, None)
        ratios = [f / p for f, p in zip(freqs, plain)]
        assert any(r == 1 for r in ratios) and any(r == 1 / params["factor"] for r in ratios)
        assert any(1 / params["factor"] < r < 1 for r in ratios)
    positions = [0, 1, 7, 1000, 4999]
    cache = precompute_rope_cache(head_dim, 5000, theta, params)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, len(positions), 1, head_dim, dtype=torch.float64, generator=g)
    rq, rk = apply_rotary_emb(x.float(), x.float(), cache[positions])
    torch.testing.assert_close(rq, rk)
    expected = torch.empty_like(x)
    for j, p in enumerate(positions):
        for i, f in enumerate(freqs):
            x0, x1 = x[0, j, 0, 2 * i].item(), x[0, j, 0, 2 * i + 1].item()
            c, s = math.cos(p * f), math.sin(p * f)
            expected[0, j, 0, 2 * i] = x0 * c - x1 * s
            expected[0, j, 0, 2 * i + 1] = x0 * s + x1 * c
    torch.testing.assert_close(rq.double(), expected, atol=2e-5, rtol=1e-5)


def test_rope_relative_position():
    head_dim = DEBUG.head_dim
    cache = precompute_rope_cache(head_dim, 2048, 500000.0, SCALINGS["3.1"])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, head_dim, generator=g)
    k = torch.randn(1, 1, 1, head_dim, generator=g)

    def score(m: int, n: int) -> float:
        rq, _ = apply_rotary_emb(q, q, cache[[m]])
        rk, _ = apply_rotary_emb(k, k, cache[[n]])
        return (rq * rk).sum().item()

    base = score(10, 3)
    for m, n in [(17, 10), (507, 500), (2000, 1993)]:
        assert score(m, n) == pytest.approx(base, abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-4)


def test_positions_argument():
    model = make_model()
    x = tokens(2, 8)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(model(x, torch.arange(8)), ref)
        torch.testing.assert_close(model(x, torch.arange(8).expand(2, 8)), ref)
        shifted = model(x, torch.arange(8) + 3)
    assert not torch.allclose(shifted, ref)


# Published counts; Llama 3.2 1B and 3B are tied (the output projection is the embedding).
PUBLISHED = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_param_counts(flavor):
    with torch.device("meta"):
        model = Decoder(llama3_flavors[flavor])
    assert model.num_params() == PUBLISHED[flavor]
    assert model.num_params(exclude_embedding=True) == PUBLISHED[flavor] - 128256 * llama3_flavors[flavor].dim
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor in ("1B", "3B"))


def test_meta_init():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Decoder(DEBUG)
    assert model.rope_cache.is_meta
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    torch.testing.assert_close(model.rope_cache, precompute_rope_cache(DEBUG.head_dim, 64, 500000.0))
    assert "rope_cache" not in model.state_dict()

    specs = model.param_init_specs()
    assert set(specs) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    wq = model.layers["0"].attention.wq.weight
    # Normal truncated at +-2 std has std 0.8796 * 0.02.
    assert wq.std().item() == pytest.approx(0.02 * 0.8796, rel=0.05)
    assert wq.abs().max().item() <= 0.04
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    for i in range(DEBUG.n_layers):
        spec = specs[f"layers.{i}.attention.wo.weight"]
        assert spec.std == pytest.approx(0.02 / math.sqrt(2 * (i + 1)))
        assert spec.b == pytest.approx(2 * spec.std)
    out = specs["output.weight"]
    assert out.kind == "trunc_normal" and out.std == DEBUG.dim**-0.5 and out.b == pytest.approx(3 * out.std)
    assert specs["tok_embeddings.weight"] == InitSpec("normal", std=1.0)

    flat = Decoder(dataclasses.replace(DEBUG, depth_init=False)).param_init_specs()
    assert flat["layers.0.feed_forward.w2.weight"].std == pytest.approx(0.02 / math.sqrt(2 * DEBUG.n_layers))


def test_apply_init_spec_generator():
    spec = InitSpec("trunc_normal", std=0.5, a=-1.0, b=1.0)
    a = apply_init_spec(torch.empty(1000), spec, torch.Generator().manual_seed(3))
    b = apply_init_spec(torch.empty(1000), spec, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.abs().max() <= 1.0
    assert torch.equal(apply_init_spec(torch.empty(3), InitSpec("zeros")), torch.zeros(3))


def test_pruned_stages_match_full_model():
    full = make_model()
    x = tokens(1, 8)
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    for i in range(3, DEBUG.n_layers):
        del first.layers[str(i)]
    first.norm = None
    first.output = None
    for i in range(3):
        del last.layers[str(i)]
    last.tok_embeddings = None

    names = {n for n, _ in last.named_parameters()}
    assert "layers.3.attention.wq.weight" in names and "output.weight" in names
    assert not any(n.startswith(("layers.0.", "tok_embeddings")) for n in names)
    assert set(last.param_init_specs()) == names
    assert last.param_init_specs()["layers.4.attention.wo.weight"].std == pytest.approx(0.02 / math.sqrt(10))

    with torch.no_grad():
        hidden = first(x)
        assert hidden.shape == (1, 8, DEBUG.dim)
        torch.testing.assert_close(last(hidden), full(x))
    last.init_weights()  # a pruned stage can still initialise itself


def test_flops_per_token():
    model = make_model()
    n = model.num_params(exclude_embedding=True)
    seq = 64
    expected = 6 * n + 12 * DEBUG.n_layers * DEBUG.dim * seq
    assert flops_per_token(DEBUG, seq) == expected
    with torch.device("meta"):
        big = Decoder(llama3_flavors["8B"])
    assert flops_per_token(llama3_flavors["8B"], 8192) == 6 * big.num_params(True) + 12 * 32 * 4096 * 8192
