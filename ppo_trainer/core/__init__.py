"""The PPO algorithm as pure torch functions: no I/O, no distributed state. Import from the
submodules; `choices` is torch-free, so config validation can use it without loading torch.

Tensors are named and shaped as the fields of `ppo_trainer.batch.Batch` (B sequences, T response
tokens), plus token_rewards [B, T]: r_t, the reward for emitting token t. Masked positions are read
only through ``torch.where``, so padding garbage, even inf or NaN, never reaches a result or a gradient.
"""
