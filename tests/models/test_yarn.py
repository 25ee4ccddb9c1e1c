"""YaRN rotary scaling (models/layers.py ``YarnScaling``) against transformers' own yarn rule."""

import math

import pytest
import torch

from torchtitan.models.layers import YarnScaling, precompute_rope_cache, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402


def _hf_yarn(config: object) -> tuple[torch.Tensor, float]:
    return ROPE_INIT_FUNCTIONS["yarn"](config)


def _deepseek_config(rope: dict) -> object:
    return transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16,
                                         max_position_embeddings=4096, rope_parameters=rope)


@pytest.mark.parametrize("truncate", [True, False])
def test_deepseek_yarn_matches_transformers(truncate: bool) -> None:
    """DeepSeek-V3's release rope: factor 40, mscale == mscale_all_dim (amplitude 1), softmax scale mscale^2."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": truncate}
    inv_freq, amplitude = _hf_yarn(_deepseek_config(rope))
    ours = YarnScaling.from_hf(rope, 4096)
    freqs = rope_frequencies(16, 10000.0, ours)
    torch.testing.assert_close(freqs.float(), inv_freq, rtol=1e-6, atol=0)
    # the blend is not trivial at these shapes: some pairs kept, some divided, some in between
    base = rope_frequencies(16, 10000.0)
    ratio = freqs / base
    assert ratio.max() == 1.0 and ratio.min() == pytest.approx(1 / 40) and ((ratio < 1) & (ratio > 1 / 40)).any()
    assert ours.rotary_amplitude() == pytest.approx(amplitude) == pytest.approx(1.0)
    assert ours.softmax_scale_multiplier() == pytest.approx((0.1 * 0.707 * math.log(40) + 1) ** 2)


def test_truncate_changes_the_band() -> None:
    rope = {"factor": 40.0, "original_max_position_embeddings": 128}
    kept, unrounded = YarnScaling.from_hf(rope, 4096), YarnScaling.from_hf({**rope, "truncate": False}, 4096)
    assert not torch.equal(kept.frequencies(16, 10000.0), unrounded.frequencies(16, 10000.0))


def test_gpt_oss_style_yarn_amplitude_in_the_cache() -> None:
    """GPT-OSS's release: no mscale keys, truncate false; the amplitude mscale(factor) scales cos and sin."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=32,
                                       max_position_embeddings=8192, rope_parameters=rope)
    inv_freq, amplitude = _hf_yarn(config)
    ours = YarnScaling.from_hf(rope, 8192)
    assert ours.rotary_amplitude() == pytest.approx(amplitude) == pytest.approx(0.1 * math.log(32) + 1)
    assert ours.softmax_scale_multiplier() == 1.0
    torch.testing.assert_close(rope_frequencies(32, 150000.0, ours).float(), inv_freq, rtol=1e-6, atol=0)
    cache = precompute_rope_cache(32, 64, 150000.0, ours)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq.double()[None]  # float64: the cache's own
    expected = (torch.cat([angles.cos(), angles.sin()], -1) * amplitude).float()
    # transformers' float32 frequencies put ~position * 6e-8 on the angle
    torch.testing.assert_close(cache, expected, rtol=0, atol=1e-5)


def test_factor_defaults_to_the_context_ratio_and_round_trips() -> None:
    ours = YarnScaling.from_hf({"original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0}, 8192)
    assert ours.factor == 8.0
    assert YarnScaling.from_hf(ours.to_hf(), 1) == ours


def test_bad_yarn_refused() -> None:
    with pytest.raises(ValueError, match="YaRN rope scaling needs"):
        YarnScaling(factor=4.0, original_context=128, beta_fast=1.0, beta_slow=32.0)


def test_non_number_yarn_entry_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"rope scaling attention_factor=\[1\.0\]: a number is expected"):
        YarnScaling.from_hf({"factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": [1.0]}, 4096)
    assert YarnScaling.from_hf({"factor": "4", "original_max_position_embeddings": 1024}, 4096).factor == 4.0
