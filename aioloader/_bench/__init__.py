"""Benchmarks: ``aioloader bench``'s workloads and the harness they share.

Owns: the workloads (``remote``, ``streams``, ``overhead``, ``cpu``, ``gpu``, ``serving``,
``serving_cost``, with ``serving_ray`` for Ray Serve where it is installed: each a
module whose ``main`` runs it and prints its own tables, as ``benchmarks/bench_*.py`` does; the
serving workload's server and load generator in ``serving_server`` and ``serving_load``), the
measuring they share (``harness``: a configuration's row, its timing and the exactly-once
checks; ``harness_child``: a configuration in a child of its own; ``harness_processes``: its
memory and CPU sampled from outside; ``harness_server``: a server in a subprocess;
``harness_table`` and ``harness_script``: a script's table, header line, flags and exit
status), the suite that runs them for the command (``suite``), its rows and tables
(``results``) and its chart (``chart``). Never: is imported by the library (only the command
line and the scripts import it); measures a peer other than as its own users would run it (a
peer that is not installed is a row that says so).
"""
