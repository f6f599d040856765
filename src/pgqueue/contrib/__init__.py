"""Integrations with other libraries and frameworks. Each imports pgqueue, never the reverse,
and its library only when it is used: ``import pgqueue`` imports none of them."""
