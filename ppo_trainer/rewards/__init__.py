"""Rewards: the rule-based math score (math), the digit tasks' reward (digits), the calling
conventions of users' functions (calling), `reward.fn` imported and checked (loader), a batch
scored in the driver or on worker processes (scoring, pool), and length shaping (shaping)."""
