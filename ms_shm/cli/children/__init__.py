"""The folder ``ms-shm run`` puts first on ``PYTHONPATH`` for the Python processes its script starts: it holds only
``sitecustomize.py``, which Python runs at every start-up."""
