"""DeepSeek-V3 (``--model.name deepseek_v3``): multi-head latent attention, fine-grained MoE with shared
experts, multi-token prediction; DeepSeek-V3, Kimi K2 and Moonlight releases."""
