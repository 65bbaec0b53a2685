"""Hypothesis profiles. CI sets CI=true and gets the "ci" profile; choose another with
HYPOTHESIS_PROFILE=dev|ci|short|thorough|mutmut|explore (or pytest --hypothesis-profile=NAME).
"short" (20 examples) is the device script's conformance profile.

Every profile but "explore" is derandomized (examples drawn from a fixed seed, no example
database), so a port gets the same verdict on every run; "explore" draws fresh random examples
and keeps a database, for hunting bugs no fixed seed reaches."""

import os

from hypothesis import HealthCheck, Phase, settings

_common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
_fixed = dict(derandomize=True, database=None, **_common)
settings.register_profile("dev", max_examples=100, **_fixed)
settings.register_profile("ci", max_examples=200, **_fixed)
settings.register_profile("short", max_examples=20, **_fixed)
settings.register_profile("thorough", max_examples=2000, **_fixed)
settings.register_profile(
    "mutmut", max_examples=60, phases=[Phase.explicit, Phase.generate], **_fixed
)
settings.register_profile("explore", max_examples=500, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
