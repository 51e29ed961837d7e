"""The seam between the driver and the workers: the driver names a worker's method by reference
(`roles.method_name` turns it into the name `Worker.call` and Ray use), so a renamed or misspelt
method, one of another role or arguments it does not take fail in the driver, and in this test for
every call the trainer makes, before any worker runs."""

from __future__ import annotations

import ast
import inspect

import pytest

from ppo_trainer import trainer
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine
from ppo_trainer.rollout import Sampler
from ppo_trainer.run import trainer_state
from ppo_trainer.workers.roles import ENGINES, Worker, method_name

GROUP_CALLS = ("run_all", "run_each", "run_split")
# What the trainer calls its groups (in trainer.py, and as `trainer` where a run's state is saved and
# loaded); any other receiver is a loop over several roles.
ROLE_OF = {f"{owner}.{role}": role for owner in ("self", "trainer") for role in ("actor", "critic", "rollout")}


def test_a_method_becomes_its_name_on_its_own_role_or_as_a_workers_own():
    assert method_name("actor", ActorEngine.update, ("batch",)) == "update"
    assert method_name("critic", CriticEngine.compute_values, ("batch",)) == "compute_values"
    assert method_name("rollout", Sampler.generate, ("prompts", 4, 1234), {"greedy": True}) == "generate"
    assert method_name("rollout", Worker.peak_memory_gb, (), {"reset": True}) == "peak_memory_gb"


@pytest.mark.parametrize("role, method, args, kwargs, message", [
    ("actor", CriticEngine.compute_values, ("batch",), {}, "CriticEngine.compute_values is not a method the actor workers run"),
    ("critic", Worker.call, ("update",), {}, "Worker.call is not a method the critic workers run"),
    ("actor", "update", ("batch",), {}, "'update' is not a method the actor workers run"),
    ("actor", ActorEngine.update, ("batch", "extra"), {}, "ActorEngine.update on the actor workers: too many positional"),
    ("critic", CriticEngine.compute_values, ("batch",), {"keep": True}, "unexpected keyword argument 'keep'"),
    ("rollout", Sampler.generate, ("prompts",), {}, "missing a required argument: 'n'"),
])
def test_a_method_of_another_role_a_name_or_arguments_it_does_not_take_fail_in_the_driver(role, method, args, kwargs,
                                                                                           message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(".", r"\.")):
        method_name(role, method, args, kwargs)


def group_calls(module) -> list[tuple[str, ast.Call]]:
    """(receiver, call) of every `<receiver>.run_all|run_each|run_split(...)` in `module`'s source."""
    return [(ast.unparse(node.func.value), node) for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GROUP_CALLS]


def arguments_as_written(call: ast.Call) -> tuple[list, dict]:
    """Placeholders for the method's arguments as the call passes them: `run_split` adds the batch's rows
    first and, with `seed=`, each replica's seed last; `run_each` passes one tuple per replica (a list or
    a comprehension of tuples); `**mapping` entries are not known here."""
    if call.func.attr == "run_each":
        per_replica = call.args[1]
        first = per_replica.elt if isinstance(per_replica, ast.ListComp) else per_replica.elts[0]
        assert isinstance(first, ast.Tuple), f"line {call.lineno}: write each replica's arguments as a tuple"
        return [None] * len(first.elts), {}
    args = [None] * (len(call.args) - 1)
    kwargs = {k.arg: None for k in call.keywords if k.arg is not None}
    if call.func.attr == "run_split" and kwargs.pop("seed", "absent") is None:
        args.append(None)
    return args, kwargs


@pytest.mark.parametrize("module, at_least", [(trainer, 14), (trainer_state, 6)])
def test_every_method_the_driver_calls_exists_on_its_roles_worker_with_a_compatible_signature(module, at_least):
    calls = group_calls(module)
    assert len(calls) >= at_least
    for receiver, call in calls:
        where = f"{module.__name__} line {call.lineno}: {ast.unparse(call)}"
        method = eval(ast.unparse(call.args[0]), vars(module))  # a reference: Worker.save, ActorEngine.update
        args, kwargs = arguments_as_written(call)
        for role in [ROLE_OF[receiver]] if receiver in ROLE_OF else list(ENGINES):
            try:
                method_name(role, method, args, kwargs)
            except TypeError as e:
                pytest.fail(f"{where}: {e}")
