"""Helpers the tests share (no test imports another test module): models, comparison
machinery, rank functions used by more than one test file."""
