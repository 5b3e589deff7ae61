"""Several workers and hosts against one database: fair claims, the database's clock, lost
hosts and lost job workers (``test_sharing.py`` in one process; ``test_hosts.py`` on
simulated hosts made of network namespaces, ``netns.py``)."""
