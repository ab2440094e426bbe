"""Data: the dataset contracts and what decides an epoch's order and a batch's shape.

Owns: the async dataset classes (``dataset``), datasets whose epochs run tasks (``epochs``),
telling a user's dataset apart and wrapping it for the pipeline (``source``), samplers, seeds and
the split of an epoch over ranks (``sampler``, ``seeds``, ``sharding``), where an epoch stands
and how it is re-divided among other ranks (``resume``, ``restream``), collation and padding
(``collate``, ``padding``). Never: schedules I/O, starts tasks, threads or processes itself.
"""
