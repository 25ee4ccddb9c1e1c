"""The tokenization boundary, row layout, the scores against hand-computed values, and bytes per token."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan.datasets import build_tokenizer
from torchtitan.datasets.token_bytes import token_byte_lengths
from torchtitan.downstream.encoding import row_tensors, split_pair
from torchtitan.downstream.scores import task_scores
from torchtitan.loss import IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(shipped_tokenizer):
    return build_tokenizer(shipped_tokenizer)


def test_a_choice_is_scored_as_its_tokens_in_running_text(tokenizer):
    context, choice = "The function returns", " the number of arguments"
    pair = split_pair(tokenizer, context, choice)
    whole = tokenizer.encode(context + choice, bos=False, eos=False)
    assert list(pair.context_ids + pair.choice_ids) == whole
    assert list(pair.context_ids) == tokenizer.encode(context, bos=False, eos=False)
    # Encoded alone, SentencePiece's dummy prefix would give the choice other tokens.
    assert list(pair.choice_ids) != tokenizer.encode(choice, bos=False, eos=False)
    assert pair.text == choice


def test_whitespace_ending_the_context_moves_to_the_choice(tokenizer):
    pair = split_pair(tokenizer, "Answer: ", "yes")
    assert pair.text == " yes"
    assert list(pair.context_ids) == tokenizer.encode("Answer:", bos=False, eos=False)
    assert list(pair.context_ids + pair.choice_ids) == tokenizer.encode("Answer: yes", bos=False, eos=False)


def test_rows_keep_bos_cut_the_context_from_the_left_and_score_only_the_choice(tokenizer):
    pair = split_pair(tokenizer, "one two three four five six seven eight nine ten", " eleven")
    seq_len = len(pair.choice_ids) + 3  # room for BOS and the last 3 context tokens
    inputs, labels = row_tensors(pair, bos_id=1, pad_id=2, seq_len=seq_len)
    n = len(pair.choice_ids)
    assert inputs.tolist() == [1, *pair.context_ids[-3:], *pair.choice_ids[:-1]]
    assert labels.tolist() == [IGNORE_INDEX] * 3 + list(pair.choice_ids)
    # A short row is padded; the padding scores nothing, and nor does a padding row.
    whole = 1 + len(pair.context_ids) + n - 1  # inputs of the uncut row
    inputs, labels = row_tensors(pair, bos_id=1, pad_id=2, seq_len=whole + 5)
    assert inputs[:whole].tolist() == [1, *pair.context_ids, *pair.choice_ids[:-1]]
    assert inputs[whole:].tolist() == [2] * 5 and (labels != IGNORE_INDEX).sum() == n
    inputs, labels = row_tensors(None, bos_id=1, pad_id=2, seq_len=8)
    assert (labels == IGNORE_INDEX).all()


def test_scores_by_hand():
    loglik = [[-3.0, -2.0, -5.0], [-4.0, -6.0], [-1.0, -1.0]]
    texts = [[" ab", " abcdef", " a"], [" aé", " abcdefgh"], [" x", " y"]]
    labels = [0, 1, 1]
    scores = task_scores(loglik, texts, labels)
    # acc: argmax picks 1 (wrong), 0 (wrong), 0 on the tie (wrong).
    assert scores["acc"] == 0.0
    # per character: [-1, -0.2857, -2.5] -> 1 (wrong); [-1.333, -0.6667] -> 1 (right); tie -> 0 (wrong).
    assert scores["acc_norm"] == pytest.approx(1 / 3)
    # the right choice's bits per byte: 3/(3 ln2), 6/(9 ln2), 1/(2 ln2), averaged.
    assert scores["bpb"] == pytest.approx((1 + 6 / 9 + 1 / 2) / 3 / math.log(2))


def test_byte_lengths_add_up_to_the_text(tokenizer):
    lengths = token_byte_lengths(tokenizer)
    text = "Bytes of wörds: \u00e9t\u00e9, 東京 and   spaces."
    ids = tokenizer.encode(text, bos=True, eos=True)
    # BOS/EOS stand for nothing; SentencePiece's dummy prefix counts one space.
    assert int(lengths[torch.tensor(ids)].sum()) == len(text.encode("utf-8")) + 1
