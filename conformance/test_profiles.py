"""Stable verdicts: every Hypothesis profile but "explore" draws the same examples on every
run, so the same port gets the same result."""

import pytest
from hypothesis import settings

from raggedspec.conformance.runner import PROFILES


@pytest.mark.rule("raggedspec conformance and its per-rule table")
@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_but_explore_is_derandomized(name):
    profile = settings.get_profile(name)
    if name == "explore":
        assert not profile.derandomize and profile.database is not None
    else:
        assert profile.derandomize and profile.database is None


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_the_runner_offers_every_registered_profile():
    for name in PROFILES:
        settings.get_profile(name)  # raises InvalidArgument for an unregistered name
    with pytest.raises(Exception, match="not registered|no such|Profile"):
        settings.get_profile("nonexistent-profile")
