"""``--kv-cache-dtype int8_static``: K/V scales per (layer, kv-head, channel) from a calibration
file.

One feature, four roles:

* :mod:`~int8kv_shim.static.cli` -- ``int8kv calibrate MODEL``: runs the model through vLLM and
  writes the file;
* :mod:`~int8kv_shim.static.recorder` -- inside vLLM's workers during calibration: records K/V
  statistics as they enter the cache;
* :mod:`~int8kv_shim.static.file` -- the file format: build, write, read, validate, slice per
  tensor-parallel rank (pure Python);
* :mod:`~int8kv_shim.static.load` -- at serving start-up: gives each layer its scales.

``calibration_data/`` holds the text ``int8kv calibrate`` runs by default.

Importing this package imports nothing (the shim's activation path must stay free of torch).
"""
