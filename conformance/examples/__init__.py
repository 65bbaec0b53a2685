"""Example backends for `raggedspec conformance --backend package.module:factory`."""
