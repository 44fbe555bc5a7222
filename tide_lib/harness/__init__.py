"""TIDE's harness: benchmarks that measure the product through its public API.

Nothing in the product imports from here.
"""
