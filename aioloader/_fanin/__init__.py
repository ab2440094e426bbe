"""Fan-in: many parts of a stream read at once, merged into one order.

Owns: the order of an interleaved epoch as pure logic (``interleave``), the reader tasks and
bounded lanes that carry it out (``lanes``) and the public ``aioloader.interleave``
(``parts``). Never: knows a source's format or transport
(``aioloader.sources`` builds on it), or the loader.
"""
