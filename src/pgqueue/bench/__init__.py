"""``pgqueue bench``: side-by-side benchmarks. Never imported by the worker or the producer."""
