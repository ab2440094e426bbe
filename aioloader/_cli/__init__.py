"""Command line: ``python -m aioloader`` and what it prints.

Owns: the commands and how their failures are said (``command``, ``errors``, ``signals``), the
demo on an embedded default (``demo``) and the progress line (``progress``). Never: holds logic
that the library's users would need from Python.
"""
