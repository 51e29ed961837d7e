"""The PPO algorithm as pure torch functions: no I/O, no distributed state. Import from the
submodules; `choices` is torch-free, so config validation can use it without loading torch."""
