"""Integrations with other libraries: each imports pgqueue, never the other way round."""
