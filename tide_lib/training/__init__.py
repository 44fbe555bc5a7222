"""EAGLE3 draft training with SpecForge: draft creation, training, export and validation.

Import from the submodules (``trainer``, ``draft``); this package stays light
so that importing a schedule does not pull in SpecForge.
"""
