"""An IPv6 Ray address (`devices.ray.address=[::1]:6379`): probed like an IPv4 one, refused in the
form Ray cannot read, taken as a string on the command line."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.overrides import normalize_overrides
from ppo_trainer.plan.dry_run import environment_problems
from ppo_trainer.workers.cluster.nodes import ray_address_problem


@pytest.fixture
def ipv6_listener() -> Iterator[int]:
    """The port of a TCP listener on ::1; skips where the machine has no IPv6 loopback."""
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here ({e})")
    with server:
        yield server.getsockname()[1]


def test_a_bracketed_ipv6_ray_address_is_probed_like_an_ipv4_one(ipv6_listener):
    assert ray_address_problem(f"[::1]:{ipv6_listener}") is None


def test_nothing_listening_at_an_ipv6_ray_address_is_named_as_such(ipv6_listener):
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as closed:
        port = closed.getsockname()[1]
    problem = ray_address_problem(f"[::1]:{port}")
    assert problem.startswith(f"devices.ray.address=[::1]:{port}: no Ray cluster answers there (Connection refused)")
    assert f"ray start --head --port={port}" in problem


def test_an_ipv6_ray_address_without_brackets_is_refused_with_the_form_ray_reads():
    assert ray_address_problem("::1:6379") == ("devices.ray.address=::1:6379: an IPv6 address needs brackets, as Ray "
                                               "reads it: devices.ray.address='[::1]:6379'")


def test_a_bracketed_ray_address_on_the_command_line_is_taken_as_a_string():
    assert normalize_overrides(["devices.ray.address=[::1]:6379"]) == ["devices.ray.address='[::1]:6379'"]
    assert normalize_overrides(["devices.ray.address=10.0.0.1:6379"]) == ["devices.ray.address=10.0.0.1:6379"]


def test_an_ipv6_ray_address_passes_the_environment_check_a_run_starts_with(ipv6_listener):
    cfg = compose(["+experiment=smoke", "devices.backend=ray", f"devices.ray.address=[::1]:{ipv6_listener}"])
    assert cfg.devices.ray.address == f"[::1]:{ipv6_listener}"
    assert [p for p in environment_problems(cfg) if "devices.ray.address" in p] == []
