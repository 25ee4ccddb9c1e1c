"""Document-masked attention: one mask_mod, its kernels, and the model's logits on packed windows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.attention import (
    DocumentMask,
    block_causal_attention,
    build_document_mask,
    check_mask_type,
    dense_mask,
    document_causal_mask_mod,
    document_ids,
    per_document_sdpa,
)
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import ModelArgs

B, H, H_KV, L, D = 2, 4, 2, 24, 8
# Row 0: documents of 5, 11 and 8 tokens; row 1: one document that started in an earlier window, then 14 tokens.
POSITIONS = torch.tensor([list(range(5)) + list(range(11)) + list(range(8)),
                          list(range(10)) + list(range(14))])


def _qkv(dtype=torch.float64, rows: int = B) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(rows, n, L, D, dtype=dtype, requires_grad=True) for n in (H, H_KV, H_KV)]


def test_document_ids_and_mask_mod():
    docs = document_ids(POSITIONS)
    assert docs[0].tolist() == [1] * 5 + [2] * 11 + [3] * 8 and docs[1].tolist() == [1] * 10 + [2] * 14
    allowed = dense_mask(document_causal_mask_mod(docs), B, L, L, docs.device)[:, 0]
    # Token 5 of row 0 starts a document: it sees itself only; token 4 sees tokens 0..4.
    assert allowed[0, 5].nonzero().flatten().tolist() == [5]
    assert allowed[0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert allowed[1, 23].nonzero().flatten().tolist() == list(range(10, 24))
    # Shifted by an offset (a CP chunk): the rows of the full mask from that query on.
    shifted = dense_mask(document_causal_mask_mod(docs, 12), B, 6, 18, docs.device)[:, 0]
    assert torch.equal(shifted, allowed[:, 12:18, :18])


# Rows of one document each (merged into one batched call), then one of two documents.
MIXED = torch.tensor([list(range(L)), list(range(L)), list(range(7)) + list(range(L - 7))])


@pytest.mark.parametrize("positions, segments", [(POSITIONS, [5, 11, 8, 10, 14]), (MIXED, [L, L, 7, L - 7])])
def test_per_document_sdpa_equals_the_dense_mask_forward_and_backward(positions, segments):
    q, k, v = _qkv(rows=positions.shape[0])
    grad = torch.randn(positions.shape[0], H, L, D, dtype=torch.float64)
    mask = build_document_mask(positions)
    assert mask.segment_lengths() == segments
    allowed = dense_mask(document_causal_mask_mod(mask.docs), positions.shape[0], L, L, q.device)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    # Head-transposed views of [B, L, heads, D], as the model hands them over, and contiguous ones.
    for views in ([t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)], [q, k, v]):
        out = block_causal_attention(*views, mask)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_one_document_per_row_is_causal_attention():
    q, k, v = _qkv()
    out = per_document_sdpa(q, k, v, [L, L])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


# Eager FlexAttention on CPU is the point here (the masks, not the fused kernel): its advice to compile is expected.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_block_mask_from_the_same_mask_mod():
    """The CUDA kernel's block mask comes from the same mask_mod; FlexAttention's forward runs on CPU too."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (t.detach().float() for t in _qkv())
    docs = document_ids(POSITIONS)
    block_mask = flex.create_block_mask(document_causal_mask_mod(docs), B, None, L, L, device="cpu")
    out = flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref = per_document_sdpa(q, k, v, DocumentMask(docs).segment_lengths())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_unknown_mask_type_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'blockcausal'.*block_causal, causal"):
        check_mask_type("blockcausal")
    with pytest.raises(ValueError, match="choose one of block_causal, causal"):
        ModelArgs(attn_mask_type="full")


def _model(mask_type: str) -> Decoder:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64,
                     attn_mask_type=mask_type)
    model = Decoder(args)
    model.init_weights()
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def test_packed_window_logits_equal_each_document_alone():
    """Window = document A (20 tokens) then B (30): A's and B's logits are those of each alone (fp32)."""
    gen = torch.Generator().manual_seed(1)
    doc_a, doc_b = torch.randint(0, 97, (1, 20), generator=gen), torch.randint(0, 97, (1, 30), generator=gen)
    window = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.cat([torch.arange(20), torch.arange(30)])[None]
    model = _model("block_causal")
    packed = model(window, positions=positions)
    a_alone, b_alone = model(doc_a), model(doc_b)
    assert _rel(packed[:, :20], a_alone) <= 1e-5
    assert _rel(packed[:, 20:], b_alone) <= 1e-5
    # Under causal B's tokens see A: their logits differ (A's do not: nothing precedes them).
    causal = _model("causal")
    causal_packed = causal(window)
    assert _rel(causal_packed[:, :20], causal(doc_a)) <= 1e-5
    assert _rel(causal_packed[:, 20:], causal(doc_b)) > 1e-2
    # Without positions every row is one document: block_causal is then the causal model, bitwise.
    assert torch.equal(model(window), causal_packed)


def test_causal_mask_type_is_bitwise_todays_model_with_positions():
    """``causal`` ignores document boundaries: passing positions only moves RoPE, as before this change."""
    model = _model("causal")
    tokens = torch.randint(0, 97, (B, L))
    with torch.no_grad():
        assert torch.equal(model(tokens, positions=torch.arange(L)), model(tokens))


def test_block_causal_backward_matches_documents_alone():
    """Gradients of a packed window equal the sum of the documents' own gradients (fp64)."""
    model = _model("block_causal").double().train()
    gen = torch.Generator().manual_seed(2)
    doc_a, doc_b = torch.randint(0, 97, (1, 9), generator=gen), torch.randint(0, 97, (1, 15), generator=gen)
    positions = torch.cat([torch.arange(9), torch.arange(15)])[None]
    model(torch.cat([doc_a, doc_b], 1), positions=positions).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (model(doc_a).sum() + model(doc_b).sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, rtol=1e-9, atol=1e-10, msg=n)


@pytest.mark.slow
def test_compiled_block_uses_the_dense_mask_and_matches_eager():
    """Also QK-clip's measurement (MuonClip) inside the compiled blocks: the same per-head maxima as eager."""
    from torchtitan.optim.qk_clip import QKClip, attention_names, heads_of

    model = _model("block_causal").train()  # QK-clip measures training forwards (the model has no dropout)
    rows = attention_names(model)
    clip = QKClip([model], rows, heads_of(model.get_submodule(rows[0])), threshold=1e9)
    tokens = torch.randint(0, 97, (B, L))
    with torch.no_grad():
        eager = model(tokens, positions=POSITIONS)
        eager_maxima = clip.measured(tokens.device)
        for block in model.layers.values():
            block.compile(fullgraph=True)
        compiled = model(tokens, positions=POSITIONS)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(eager_maxima).all()
    torch.testing.assert_close(clip.measured(tokens.device), eager_maxima, rtol=1e-5, atol=1e-5)


def test_model_args_replace_keeps_the_mask_type():
    args = dataclasses.replace(ModelArgs(), attn_mask_type="causal")
    assert args.attn_mask_type == "causal" and ModelArgs().attn_mask_type == "block_causal"
