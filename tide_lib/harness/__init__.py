"""TIDE's harness: the benchmarks, the workloads and the demo, apart from the product.

They measure and show the product through its public API; nothing in the product
imports from here (``tests/test_layering.py``). Their commands reach ``tide``
through the ``tide.commands`` entry points (:mod:`tide_lib.harness.cli`).
"""
