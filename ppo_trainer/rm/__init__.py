"""`ppo-train-rm`: a reward model (a one-label sequence classifier) trained on preference pairs with
the Bradley-Terry loss: the pairs (`pairs`), the model on FSDP2 (`engine`), the run (`train`)."""
