"""raggedspec conformance suite: spec examples, reference properties, reference-vs-port."""
