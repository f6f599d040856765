"""pgqueue's tables are not Django models: ``manage.py migrate`` applies pgqueue's own
migrations after Django's (apps.py). This module only lets Django send that signal, which it
sends to apps with a models module."""
