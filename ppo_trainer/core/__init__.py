"""The PPO algorithm as pure torch functions: no I/O, no distributed state. Import from the
submodules; `choices` is torch-free, so config validation can use it without loading torch.

Symbols and shapes of every module here (B sequences, T response tokens; masked positions are
read only through ``torch.where``, so padding garbage, even inf or NaN, never reaches a result or
a gradient):

===============  =====  ==============================================================
scores           [B]    the reward function's score of each whole response
logprobs         [B,T]  log pi(a_t | s_t) under the policy being optimised
old_logprobs     [B,T]  the same under the policy at the start of this PPO step
ref_logprobs     [B,T]  the same under the frozen reference policy
sample_logprobs  [B,T]  the same under the sampler's policy pi_rollout
values           [B,T]  V(s_t): the critic's value of the state *before* token t
old_values       [B,T]  V(s_t) at rollout time
token_rewards    [B,T]  r_t, reward received for emitting token t
response_mask    [B,T]  1 on real response tokens (up to and including EOS), 0 on padding
advantages       [B,T]  GAE advantage A_t (whitened for the policy loss); 0 on padding
returns          [B,T]  A_t + V(s_t), the critic's target; 0 on padding
===============  =====  ==============================================================
"""
