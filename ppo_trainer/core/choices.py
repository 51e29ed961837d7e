"""The allowed values of the algorithm's string options: one place for config validation (which
must stay fast, so this module imports nothing) and for the core functions that dispatch on them."""

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # algorithm.loss_agg_mode
KL_KINDS = ("k1", "abs", "k2", "k3")  # gae.kl_penalty, algorithm.kl_loss_type
KL_CTRLS = ("fixed", "adaptive")  # gae.kl_ctrl
LAM_MODES = ("fixed", "adaptive")  # gae.lam_mode
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")  # algorithm.rollout_correction
POSITIVE_EXAMPLES = ("correct", "group_best")  # algorithm.positive_lm_examples
VALUE_HEAD_INITS = ("loaded", "regression")  # critic.value_head_init
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus")  # algorithm.adv_estimator; all but gae are critic-free
GROUP_ESTIMATORS = ("grpo", "rloo")  # the estimators that compare a prompt's samples: they need sampler.n >= 2
FILTER_METRICS = ("score", "acc")  # algorithm.filter_groups_metric
