"""Loader: the ``DataLoader`` torch users know, and the scopes its epochs run in.

Owns: the ``DataLoader`` class (``loader``; its attributes as views of the plan in
``settings``, its scope opened and closed in ``lifecycle``, its ``state_dict`` and
``load_state_dict`` in ``state_dict``), its argument checks in torch's words (``arguments``),
the frozen plan a scope runs with (``plan``), the scope that owns the worker pool and device
stage over epochs (``scope``), and the background loop of a plain ``for`` (``session``).
Never: carries out an epoch's data path itself (``_pipeline`` does).
"""
