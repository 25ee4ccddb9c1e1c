"""The brute-force reference of downstream scores: one process, one request choice at a time, no batching.

Each choice's row (``[BOS] + context + choice``, the context cut from the left to fit ``seq_len``,
as the evaluator does) goes through a whole, unsharded model alone, without padding; its
log-likelihood is the float64 sum of ``log_softmax`` at the choice's tokens. The scores are
computed here from those numbers with plain loops, not with ``downstream/scores.py``.
"""

from __future__ import annotations

import math

import torch

from torchtitan.downstream.encoding import split_pair
from torchtitan.downstream.request import Task


def reference_model(cfg, state: dict[str, torch.Tensor]) -> torch.nn.Module:  # noqa: ANN001 - a JobConfig
    """The job's model in this process, with ``state`` (a full state dict) loaded."""
    from torchtitan.preflight import preflight

    plan = preflight(cfg, 1, check_data=False)
    model = plan.model_spec.build(plan.model_args)
    model.init_weights()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("freqs" in name for name in missing), (missing, unexpected)
    return model.eval()


@torch.no_grad()
def choice_loglik(model: torch.nn.Module, tokenizer, context: str, choice: str, seq_len: int,  # noqa: ANN001
                  positions: bool) -> tuple[float, str]:
    """The log-likelihood of ``choice`` after ``context``, and the choice text it scored."""
    pair = split_pair(tokenizer, context, choice)
    room = seq_len - len(pair.choice_ids)
    context_ids = list(pair.context_ids)[-room:] if room > 0 else []
    tokens = torch.tensor([[tokenizer.bos_id, *context_ids, *pair.choice_ids]])
    inputs = tokens[:, :-1]
    kwargs = {"positions": torch.arange(inputs.shape[1])[None]} if positions else {}
    logp = torch.log_softmax(model(inputs, **kwargs).double(), dim=-1)[0]
    n = len(pair.choice_ids)
    targets = tokens[0, -n:]
    return float(logp[-n:].gather(1, targets[:, None]).sum()), pair.text


def reference_scores(model: torch.nn.Module, tokenizer, task: Task, seq_len: int,  # noqa: ANN001
                     positions: bool) -> dict[str, float]:
    acc = acc_norm = bpb = 0.0
    for request in task.requests:
        scored = [choice_loglik(model, tokenizer, request.context, c, seq_len, positions) for c in request.choices]
        lls = [ll for ll, _ in scored]
        per_char = [ll / len(text) for ll, text in scored]
        acc += lls.index(max(lls)) == request.label
        acc_norm += per_char.index(max(per_char)) == request.label
        gold_ll, gold_text = scored[request.label]
        bpb += -gold_ll / len(gold_text.encode("utf-8")) / math.log(2)
    n = len(task.requests)
    return {f"eval/{task.name}/acc": acc / n, f"eval/{task.name}/acc_norm": acc_norm / n,
            f"eval/{task.name}/bpb": bpb / n}
