"""Base: what every wing uses.

Owns: the exceptions and the notes they carry (``exceptions``), argument checks with one rule
(``checks``), the retry policy (``retry``), the statistics recorders (``stats``) and walking
containers of tensors (``tree``). Never: imports another wing of the package.
"""
