"""Imported last by the benchmarks' fork server (``harness_child.preloaded_forkserver``): moves
every object the server holds into the garbage collector's permanent generation (``gc.freeze``),
so that a child's collections neither walk them (a collection over torch's objects takes a tenth
of a second) nor write to their pages, which stay shared with the server instead of being
copied into each child."""

import gc

gc.collect()
gc.freeze()
