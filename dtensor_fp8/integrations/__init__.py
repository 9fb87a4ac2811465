"""Glue for training frameworks whose own machinery (config, model build, optimizer, checkpoint)
should carry FP8 parameters. Each submodule imports its framework; ``import dtensor_fp8`` imports
none of them.

* ``torchtitan``: a model-config converter, an optimizers container and the state-dict layout
  torchtitan's checkpointer saves (torchtitan 0.3, torch >= 2.14).
"""
