"""One small hierarchy for every refusal the spec names.

A *refusal* is a rule saying no (the spec's "refused ... with a message"): it raises a
subclass of `Refusal` whose message contains the spec's quoted keywords and names the
offending values. Malformed input (wrong shapes, negative lengths, wrong types) is not a
refusal: it raises a plain `ValueError` naming the bad value.

The GPU port raises the same classes, so conformance can compare "refused by both".
"""


class Refusal(Exception):
    """A rule of the spec declined the request; the message says which and why."""


class CacheRefusal(Refusal):
    """A KV-cache or compressor-history slot refused a length, append or pad/strip."""


class AlignRefusal(Refusal):
    """Batch assembly or a draft-group alignment refused its rows."""


class DispatchRefusal(Refusal):
    """A dispatch resolver refused an inconsistent per-row vector."""


class MaskRefusal(Refusal):
    """A mask or attention rule refused its geometry."""


class CapabilityRefusal(Refusal):
    """A capability check refused per-sequence KV advance."""


class StepRefusal(Refusal):
    """A step-level guard (left-aligned / follows guard, commit, chain) refused the step."""


class SchedulerRefusal(Refusal):
    """A scheduler or admission rule refused."""


class ScenarioError(ValueError):
    """A malformed scenario: the message names the key and the allowed range or values."""


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds: the malformed-input check."""
    if not condition:
        raise ValueError(message)
