"""QK-clip (``--optimizer.name MuonClip``): the per-head max logit measured in the forward against a brute-force max
of the whole masked logits, the clip's scaling (GQA: the clipped heads' queries; MLA: compressed parts by sqrt(gamma),
rotary query by gamma, the shared rotary key untouched), the step hook and what preflight refuses. The sharded
layout against one process: test_qk_clip_layouts.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchtitan.models.attention import DocumentSDPA, GQAConfig, GroupedQueryAttention, build_document_mask
from torchtitan.models.attention import max_logit as max_logit_module
from torchtitan.models.attention.max_logit import max_logits, take
from torchtitan.models.deepseek_v3.mla import MLAConfig, MultiHeadLatentAttention
from torchtitan.models.layers import apply_rotary_emb, precompute_rope_cache
from torchtitan.optim.qk_clip import QKClip, attention_names

B, L, DIM = 2, 12, 16
# two documents in row 0 (the second starts at 5), one in row 1
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(L))])


class _Holder(nn.Module):
    """A model of one attention module (its table row is ``attention``)."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention


def _allowed(documents: bool, window: int | None = None) -> torch.Tensor:
    """[B, 1, L, L]: the mask written out (no masks.py): earlier keys, of the same document, within the window."""
    q, k = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    keep = (q >= k).expand(B, L, L)
    if documents:
        doc = (POSITIONS == 0).cumsum(-1)
        keep = keep & (doc.unsqueeze(2) == doc.unsqueeze(1))
    if window is not None:
        keep = keep & (q - k < window)
    return keep.unsqueeze(1)


def _brute_max(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


def _gqa(seed: int = 0) -> GroupedQueryAttention:
    torch.manual_seed(seed)
    m = GroupedQueryAttention(GQAConfig(DIM, n_heads=4, n_kv_heads=2, head_dim=8))
    for lin in m.in_projections():
        nn.init.normal_(lin.weight, std=0.5)
    return m


def _mla(q_lora_rank: int, seed: int = 0) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(MLAConfig(DIM, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8,
                                           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, norm_eps=1e-6,
                                           softmax_scale=0.3))
    for lin in m.in_projections():
        nn.init.normal_(lin.weight, std=0.5)
    return m


def _gqa_logits(m: GroupedQueryAttention, x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, L] from the weights: rotated q . k / sqrt(head_dim), each query head against its group's key."""
    xq = m.wq(x).view(B, L, 4, 8)
    xk = m.wk(x).view(B, L, 2, 8)
    xq, xk = apply_rotary_emb(xq, xk, precompute_rope_cache(8, L, 10000.0))
    return torch.einsum("bqhd,bkhd->bhqk", xq, xk.repeat_interleave(2, dim=2)) / math.sqrt(8)


def _mla_logits(m: MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, L] from the weights: (q_nope . k_nope + q_rope . k_rope) * softmax_scale."""
    q_nope, q_rope = m.queries(x).view(B, L, 4, 8).split([4, 4], dim=-1)
    latent, k_rope = m.wkv_a(x).split([8, 4], dim=-1)
    q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(2), precompute_rope_cache(4, L, 10000.0))
    k_nope = m.wkv_b(m.kv_norm(latent)).view(B, L, 4, 10)[..., :4]
    return (torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
            + torch.einsum("bqhd,bkhd->bhqk", q_rope, k_rope.expand(-1, -1, 4, -1))) * 0.3


def _measure(model: _Holder, clip: QKClip, x: torch.Tensor, documents: bool) -> torch.Tensor:
    """The forward's measured maxima [H] (the module's buffer, as the clip reads it)."""
    m = model.attention
    rope = precompute_rope_cache(m.head_dim if isinstance(m, GroupedQueryAttention) else 4, L, 10000.0)
    with torch.no_grad():
        m(x, rope, backend=DocumentSDPA(), documents=build_document_mask(POSITIONS) if documents else None)
    return take(clip.watched[0].module)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("attention", ["gqa", "mla", "mla_q_lora"])
def test_measured_max_equals_brute_force(attention, documents, monkeypatch):
    monkeypatch.setattr(max_logit_module, "CHUNK_ELEMENTS", B * 4 * L * 5)  # 5 query rows a chunk: 3 chunks
    m = _gqa() if attention == "gqa" else _mla(8 if attention == "mla_q_lora" else 0)
    model = _Holder(m)
    clip = QKClip([model], attention_names(model), 4, threshold=100.0)
    x = torch.randn(B, L, DIM)
    logits = _gqa_logits(m, x) if attention == "gqa" else _mla_logits(m, x)
    expected = _brute_max(logits.detach(), _allowed(documents))
    torch.testing.assert_close(_measure(model, clip, x, documents), expected, rtol=1e-5, atol=1e-5)


def test_window_and_chunks_against_brute_force(monkeypatch):
    monkeypatch.setattr(max_logit_module, "CHUNK_ELEMENTS", 1)  # one query row a chunk
    torch.manual_seed(3)
    q, k = torch.randn(B, 4, L, 8), torch.randn(B, 2, L, 8)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) / math.sqrt(8)
    documents = build_document_mask(POSITIONS)
    for window in (None, 3):
        expected = _brute_max(logits, _allowed(True, window))
        torch.testing.assert_close(max_logits(q, k, documents, window), expected, rtol=1e-5, atol=1e-5)


def _threshold_between(maxima: torch.Tensor) -> float:
    """A threshold with two heads above it and two under."""
    ordered = maxima.sort().values
    return float((ordered[1] + ordered[2]) / 2)


@pytest.mark.parametrize("attention", ["gqa", "mla", "mla_q_lora"])
def test_clip_scales_clipped_heads_to_the_threshold_and_leaves_the_others(attention):
    m = _gqa() if attention == "gqa" else _mla(8 if attention == "mla_q_lora" else 0)
    model = _Holder(m)
    x = torch.randn(B, L, DIM)
    before = {name: p.detach().clone() for name, p in m.named_parameters()}
    logits = (_gqa_logits(m, x) if attention == "gqa" else _mla_logits(m, x)).detach()
    first = _brute_max(logits, _allowed(True))
    tau = _threshold_between(first)
    clip = QKClip([model], attention_names(model), 4, threshold=tau)
    _measure(model, clip, x, documents=True)
    m.get_buffer("max_logits").copy_(first)  # the measured maxima (checked against brute force above)
    clip.step()
    clipped = first > tau
    gamma = torch.where(clipped, tau / first, torch.ones_like(first))
    after_logits = (_gqa_logits(m, x) if attention == "gqa" else _mla_logits(m, x)).detach()
    # every head's logits scaled by exactly its gamma: the clipped ones' maxima land on tau
    torch.testing.assert_close(after_logits, logits * gamma.view(1, 4, 1, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_brute_max(after_logits, _allowed(True))[clipped], torch.full((2,), tau), rtol=1e-5,
                               atol=0)
    after = dict(m.named_parameters())
    query = "wq.weight" if attention != "mla_q_lora" else "wq_b.weight"
    rows_per_head = before[query].shape[0] // 4
    for h in torch.nonzero(~clipped).flatten().tolist():  # heads under the threshold: bitwise as they were
        rows = slice(h * rows_per_head, (h + 1) * rows_per_head)
        assert torch.equal(after[query][rows], before[query][rows])
    untouched = [n for n in before if n != query and n != "wkv_b.weight"]  # keys of GQA, MLA's wkv_a (rotary key)
    assert all(torch.equal(after[n], before[n]) for n in untouched), untouched
    if attention != "gqa":  # MLA: the values' rows of wkv_b untouched, the compressed keys by sqrt(gamma)
        kv_before, kv_after = before["wkv_b.weight"].view(4, 10, -1), after["wkv_b.weight"].view(4, 10, -1)
        assert torch.equal(kv_after[:, 4:], kv_before[:, 4:])
        torch.testing.assert_close(kv_after[:, :4], kv_before[:, :4] * gamma.sqrt().view(4, 1, 1))


def test_qk_norm_attention_is_refused_by_the_clip():
    m = GroupedQueryAttention(GQAConfig(DIM, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm_eps=1e-6))
    model = _Holder(m)
    with pytest.raises(ValueError, match="QK-norm"):
        QKClip([model], attention_names(model), 4, threshold=1.0)


def test_muon_clip_through_the_optimizer_step_hook_and_its_logged_term():
    """build_optimizer's MuonClip is Muon with the clip after every step (on the stepped weights, by the step's
    measured maxima), and the term logs the max logit."""
    import dataclasses

    from torchtitan.models.registry import get_model_spec, model_args
    from torchtitan.optim import build_optimizer
    from torchtitan.train_step.max_logit import MaxLogitTerm, install_qk_clip
    from torchtitan.train_step.objective import CrossEntropyTerm, Objective

    torch.manual_seed(0)
    model = get_model_spec("llama3").build(dataclasses.replace(model_args("llama3", "debugmodel"), n_layers=2))
    model.init_weights(buffer_device=torch.device("cpu"))
    model.train()
    rows = attention_names(model)
    term = MaxLogitTerm(rows, 16, threshold=0.05)  # below the debug model's first logits (about 0.4)
    objective = Objective([CrossEntropyTerm(lambda out, labels: out.sum()), term])
    optimizer = build_optimizer([], name="MuonClip", lr=1e-3, eps=1e-8, weight_decay=0.0, betas=(0.9, 0.95),
                                device_type="cpu", model_parts=[model])
    attentions = [model.get_submodule(r) for r in rows]
    stepped: list[tuple[torch.Tensor, torch.Tensor]] = []
    optimizer.register_step_post_hook(  # runs first: the weights the step made, before the clip
        lambda *_: stepped.extend((a.wq.weight.detach().clone(), a.wk.weight.detach().clone()) for a in attentions))
    clip = install_qk_clip(optimizer, [model], objective, tp_mesh=None)
    assert clip is not None and len(clip.watched) == len(rows) == 2
    model(torch.randint(0, 256, (1, 16))).float().square().mean().backward()
    optimizer.step()
    logged = objective.metrics([])
    assert clip.last is not None and logged["attn/max_logit"] == float(clip.last.max()) > 0.05
    assert logged["attn/clipped_heads"] == 2 * 16, logged
    for a, (wq, wk), maxima in zip(attentions, stepped, clip.last):
        torch.testing.assert_close(a.wq.weight.detach(), wq * (0.05 / maxima).repeat_interleave(a.head_dim)[:, None])
        assert torch.equal(a.wk.weight, wk)


@pytest.mark.parametrize(("option", "config", "line"), [
    ("--optimizer.qk_clip_threshold=0", "debug_model.toml", "--optimizer.qk_clip_threshold=0"),
    ("--fault_tolerance.enable", "debug_model.toml", "--optimizer.name=MuonClip with --fault_tolerance.enable"),
    ("--parallelism.context_parallel_degree=2", "debug_model.toml",
     "--optimizer.name=MuonClip with --parallelism.context_parallel_degree=2"),
    (None, "qwen3_debug_moe.toml", "--optimizer.name=MuonClip: qwen3: its attention normalizes"),
])
def test_what_muon_clip_cannot_do_is_refused_in_one_line(option, config, line, debug_cfg):
    from torchtitan.preflight import check_config

    extra = [option] if option else []
    cfg = debug_cfg("--optimizer.name=MuonClip", *extra, config=f"train_configs/{config}")
    problems = [p for p in check_config(cfg) if "MuonClip" in p or "qk_clip" in p]
    assert len(problems) == 1 and problems[0].startswith(line), problems


@pytest.mark.parametrize("config", ["debug_model.toml", "deepseek_v3_debug.toml", "gpt_oss_debug.toml"])
def test_muon_clip_on_gqa_mla_and_sink_attention_is_accepted(config, debug_cfg):
    from torchtitan.preflight import check_config

    cfg = debug_cfg("--optimizer.name=MuonClip", config=f"train_configs/{config}")
    assert not [p for p in check_config(cfg) if "MuonClip" in p or "qk_clip" in p]
