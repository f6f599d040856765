"""A small shop whose orders send a receipt through pgqueue, in several frameworks."""
