"""The worker runtime: one module per service, wired together by ``runtime.Worker``."""
