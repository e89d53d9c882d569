"""One-off investigations behind figures the docs quote: each runs from a checkout as
``python -m records.investigations.NAME`` and may use bench's private helpers
(``bench._ports``, ``bench._limit``, ...). The benchmarks a user runs are in bench/."""
