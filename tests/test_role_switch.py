"""A worker's role and the switch being drained (serving/worker/role_switch.py), in-process:
requests keep the role they were taken in; a switch ends once none of the old role's work is
held; a second switch while one drains redirects it."""

import pytest

from epdserve.serving.worker.role_switch import Roles

pytestmark = pytest.mark.elastic


def test_requests_keep_the_role_they_were_taken_in():
    roles = Roles("decode")
    roles.take("fetching")  # a decode request whose KV is on its way
    roles.begin("prefill", "s1", 0.0, holding={"fetching", "running"})
    assert roles.role == "prefill" and roles.role_of("fetching") == "decode"
    assert roles.role_of("new") == "prefill"  # taken at once, in the new role
    roles.take("x")
    roles.forget("x")
    assert roles.role_of("x") == "prefill"


def test_a_switch_drains_then_ends_and_a_second_redirects_it():
    roles = Roles("colocated")
    roles.begin("prefill", "s1", 0.0, holding={"a", "b"})
    assert roles.drained({"a", "b", "c"}) is None  # c is the new role's
    roles.begin("decode", "s2", 1.0, holding={"c"})  # redirected: a, b and c drain
    assert roles.switch.previous == "colocated" and roles.switch.held == {"a", "b", "c"}
    assert roles.drained({"b"}) is None
    done = roles.drained(set())
    assert (done.previous, done.switch_id, roles.role, roles.switch) == ("colocated", "s2", "decode", None)
    assert roles.drained(set()) is None  # none left to announce


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role 'chef'"):
        Roles("chef")
