"""The benchmarks: ``manage.py bench_*`` and ``python -m benchmarks.jobs``.

They live outside what they measure (a layer of their own, beside `sagehost`): they import
the apps (`agents`, `scheduling`, `pooling`) and the kernel (`sageproject`), and nothing
imports them (the import-linter contract in ``pyproject.toml``). Each command prints one
JSON line per measured path; tests never assert wall-clock speed.

- ``management/commands/``: ``bench_pooling`` and ``bench_elastic`` (pooling's core),
  ``bench_single_host``, ``bench_fairness``, ``bench_persist``,
  ``bench_session_projection`` (scheduling), ``bench_e2e`` and ``bench_scale`` (the host
  end to end, and as workers are added).
- `benchmarks.e2e`: ``bench_e2e``'s pieces, one concern a module.
- `benchmarks.shared`: the database benchmarks' users, rows and clean-up.
- `benchmarks.peers`: ``bench_e2e``'s peers (other task queues) and fake model server.
- `benchmarks.jobs`: throughput of a job runtime for trivial jobs.

Bench-only dependencies (``requirements-bench.txt``, psutil) are imported where they are
used, so ``make run`` and ``make test`` need none of them.
"""
