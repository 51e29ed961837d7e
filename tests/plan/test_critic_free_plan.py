"""The dry run of a critic-free algorithm.adv_estimator: no critic in the plan, the memory plan or
the placement, and a line saying what the estimator computes instead of GAE's lambdas."""

from __future__ import annotations

from ppo_trainer.config.composition import compose
from ppo_trainer.plan.dry_run import describe_plan
from ppo_trainer.workers.cluster.placement import plan_placement


def plan_lines(*overrides: str) -> list[str]:
    return describe_plan(compose(["+experiment=gsm8k_cpu", *overrides]), []).split("# plan")[1].splitlines()


def test_the_dry_run_says_the_run_has_no_critic_and_what_its_estimator_computes():
    lines = plan_lines("algorithm.adv_estimator=grpo")
    assert ("critic:    none (algorithm.adv_estimator=grpo is critic-free: the critic.* keys and devices.critic "
            "are not used)") in lines
    assert ("advantages: grpo: a response's summed token rewards minus the mean of its prompt's 4 samples, divided "
            "by their std; gae.lam, gae.critic_lam, gae.lam_mode and gae.normalize_advantages are GAE's and not "
            "used") in lines
    assert not any(line.startswith("lambda:") for line in lines)
    assert next(line for line in lines if line.startswith("dtypes:")).count("critic") == 0
    assert "  actor, rollout share one cpu device in this process" in lines


def test_the_dry_run_names_rloos_baseline_and_reinforce_plus_plus_returns():
    assert any(line.startswith("advantages: rloo: a response's summed token rewards minus the mean of its prompt's "
                               "3 other samples") for line in plan_lines("algorithm.adv_estimator=rloo"))
    assert any(line.startswith("advantages: reinforce_plus_plus: discounted returns of the token rewards "
                               "(gae.gamma=1.0), whitened") for line in
               plan_lines("algorithm.adv_estimator=reinforce_plus_plus"))
    assert any("not divided by their std (algorithm.norm_adv_by_std_in_grpo=false)" in line for line in
               plan_lines("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false"))


def test_the_memory_plan_holds_no_critic_and_needs_less():
    def total(lines: list[str]) -> float:
        return float(next(line for line in lines if line.startswith("  total")).split()[1])

    gae, grpo = plan_lines(), plan_lines("algorithm.adv_estimator=grpo")
    assert any(line.startswith("  critic ") for line in gae)
    assert not any(line.startswith("  critic ") for line in grpo)
    assert total(grpo) < total(gae)


def test_placement_reserves_no_device_for_a_critic():
    cfg = compose(["devices=multi_gpu", "algorithm.adv_estimator=grpo", "sampler.n=2"])
    placement = plan_placement(cfg)
    assert sorted(placement.roles) == ["actor", "rollout"]
    assert placement.num_devices == 8  # 4 actor + 4 rollout; devices.critic's 4 are not reserved
