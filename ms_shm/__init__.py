"""ms_shm: keeps MindSpore data pipelines alive and fast (placeholder while the core lands)."""
import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())
