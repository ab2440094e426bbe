"""Base: what every wing uses.

Owns: the exceptions and the notes they carry (``exceptions``), argument checks with one rule
(``checks``), the retry policy (``retry``), the statistics recorders (``stats``), walking
containers of tensors (``tree``), where public objects say they live (``public``) and how long a
repeated call has been taking (``recent``). Never: imports another wing of the package.
"""
