"""Command line: ``python -m aioloader`` and what it prints.

Owns: the demo on an embedded default (``demo``) and the progress line (``progress``). Never:
holds logic that the library's users would need from Python.
"""
