"""``pgqueue demo``: a throwaway PostgreSQL, demo tasks, producers, two workers and the dashboard.

``tasks`` is an ordinary pgqueue app (the workers load it with ``--app pgqueue.demo.tasks:app``);
``runner`` starts and stops everything around it.
"""
