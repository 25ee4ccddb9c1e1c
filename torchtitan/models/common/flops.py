"""Parameter and FLOP counts of the decoder (``decoder.py``) from its arguments alone."""

from __future__ import annotations

from torchtitan.models.common.config import DecoderConfig


def param_counts(args: DecoderConfig) -> tuple[int, int]:
    """(total, active per token) parameters, embedding and output included (a tied one once).

    Active counts top_k of the routed experts in each sparse layer, its shared experts, and the router.
    """
    attn = args.attention().num_params() + 2 * args.dim  # the block's two norms with it
    dense = 3 * args.dim * args.dense_ffn_dim()
    moe = args.moe_args() if args.num_experts else None
    expert = 3 * args.dim * moe.hidden_dim if moe is not None else 0
    total = active = 0
    for i in range(args.n_layers):
        if moe is not None and args.is_moe_layer(i):
            shared = moe.num_shared_experts * expert
            total += attn + moe.num_experts * expert + shared + args.dim * moe.num_experts
            active += attn + moe.top_k * expert + shared + args.dim * moe.num_experts
        else:
            total += attn + dense
            active += attn + dense
    ends = args.dim + args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    return total + ends, active + ends


def flops_per_token(args: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active + 12 * n_layers * (n_heads * head_dim) * seq_len.

    N_active: the parameters a token's matmuls use (top_k experts of each sparse layer, the router,
    the output projection; not the embedding lookup). The second term is QK^T and AV over the full
    sequence, forward and backward, as Llama 3 counts it (with the attention width n_heads * head_dim).
    """
    _, active = param_counts(args)
    n = active - args.vocab_size * args.dim  # the lookup does no matmul; a tied output still does
    if args.tie_word_embeddings:
        n += args.vocab_size * args.dim
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
