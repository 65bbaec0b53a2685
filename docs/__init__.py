"""The rule table (rules.md) and the spec index (spec-rules.txt), shipped with the package:
`raggedspec conformance` reads the table at run time through importlib.resources."""
