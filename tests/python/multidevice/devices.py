"""Imported first by every test module here: JAX gets 8 CPU devices, which it takes only before
its backends start (so this folder runs in a pytest process of its own: tests/python/conftest.py).
"""

from __future__ import annotations

import jax

NUM_DEVICES = 8

# Raises if a backend has already started, so these tests never run on fewer devices unnoticed.
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
assert len(jax.devices()) == NUM_DEVICES
