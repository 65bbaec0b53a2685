"""Hypothesis profiles. CI sets CI=true and gets the "ci" profile; choose another with
HYPOTHESIS_PROFILE=dev|ci|short|thorough|mutmut (or pytest --hypothesis-profile=NAME). "short"
(20 examples, derandomized) is the GPU run script's conformance profile."""

import os

from hypothesis import HealthCheck, Phase, settings

_common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, **_common)
settings.register_profile("ci", max_examples=200, derandomize=True, database=None, **_common)
settings.register_profile("short", max_examples=20, derandomize=True, database=None, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.register_profile("mutmut", max_examples=60, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
