"""Workers: where CPU work runs, and who the workers are.

Owns: ``get_worker_info`` and the worker process' main loop (``worker``), the process pool
(``processes``) and its fork server (``forkserver``), the thread pool (``offload``), the
protocol both answer (``pool``), the functions a worker runs for a batch (``job``) and the
shared-memory hand-back of tensors (``pack``). Never: decides an epoch's order or its failures.
"""
