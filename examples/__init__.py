"""User-facing examples. The guides in docs/ include these files, and tests/ run them."""
