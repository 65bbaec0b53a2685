"""Example scenarios, shipped with the package (`raggedspec simulate --example NAME`)."""
